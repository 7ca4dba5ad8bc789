"""Artifacts in the store: contents by SHA-256 in chunks, and each run's listing.

Three tables (relay/store/schema.py, version 11): ``artifact_blobs`` (one row per distinct
content: size, chunk count, when last used), ``artifact_chunks`` (its bytes, in chunks of
:data:`CHUNK_BYTES`) and ``run_artifacts`` (each run's entries in order: name, size,
sha256, content type, truncated, skipped). Every replica reads them; nothing of an artifact
lives in one process's memory or on its disk.

The API, for the run that collects (relay/runs/artifacts.py) and for whoever serves them:

- :meth:`Artifacts.writer` → a :class:`BlobWriter`: ``await write(data)`` any number of
  times (each full chunk is one short transaction, so memory holds at most a chunk), then
  ``await finish()`` → ``(sha256, size)``; content already stored is kept once (the new
  chunks are dropped). ``await discard()`` drops an upload never finished; one a relay died
  in is pruned later (its chunks are named ``up_<unix time>_…``).
- :meth:`Artifacts.record` writes a run's listing, once, in one transaction.
- :meth:`Artifacts.for_runs` reads the listings of some runs (the run's JSON);
  :meth:`Artifacts.find` one entry by run and name (what a download asks first).
- :meth:`Artifacts.token_bytes` is what one token's runs' listings keep, counted in
  ``token_artifacts`` as listings are written and pruned: the run that collects asks it
  once (one lookup by key), against RELAY_ARTIFACTS_MAX_TOKEN_BYTES.
- :meth:`Artifacts.chunks` streams a blob's bytes, or a range of them, one chunk per query:
  a download holds one chunk in memory, whatever the size. A blob pruned meanwhile raises
  :class:`BlobMissing`.

With RELAY_ARTIFACTS_URL set the contents go to object storage instead
(relay/store/objects.py): :class:`ObjectWriter` in place of the chunk rows, the blob's row
with ``chunks = chunk_bytes = 0``, and :meth:`Artifacts.chunks` reading the object by range.

Retention (relay/store/retention.py) deletes a pruned run's listing with it, then the blobs
no listing names whose ``used_at`` is older than its cutoff (a blob is touched whenever a
run stores it anew, so one a run is naming right now is never deleted), then uploads
abandoned before the cutoff.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from relay.store.database import Store, is_store_failure
from relay.store.objects import ObjectMissing, Objects, StorageFailed, upload_name
from relay.store.schema import (
    artifact_blobs,
    artifact_chunks,
    run_artifacts,
    runs,
    token_artifacts,
)

CHUNK_BYTES = 256 * 1024
"""Bytes per chunk row: small enough to hold one per download, large enough that a 16 MiB
artifact is 64 rows."""
UPLOAD_PREFIX = "up_"
"""Starts the name an upload's chunks carry until it is finished: ``up_<10-digit unix
time>_<hex>``, so what a relay died writing is found, and aged, by its name alone."""


class BlobMissing(LookupError):
    """The blob is not (or no longer) stored: pruned, never finished, or its object gone
    from the bucket."""


@dataclass(frozen=True)
class StoredArtifact:
    """One entry of a run's listing (a row of ``run_artifacts``)."""

    name: str
    size: int = 0
    sha256: str | None = None
    content_type: str = "application/octet-stream"
    truncated: bool = False
    skipped: str | None = None


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob: its size in bytes, how many chunks hold it and their size."""

    sha256: str
    size: int
    chunks: int
    chunk_bytes: int


class BlobWriter:
    """One blob being written: bytes in, chunk rows out, its SHA-256 at the end."""

    def __init__(self, store: Store, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        """The size of each chunk row but the last (kept with the blob, read back by it)."""
        self.upload = f"{UPLOAD_PREFIX}{int(time.time()):010d}_{secrets.token_hex(8)}"
        self.size = 0
        self._hash = hashlib.sha256()
        self._pending = bytearray()
        self._written = 0  # chunk rows so far

    async def write(self, data: bytes) -> None:
        """Add ``data``; each full chunk is written at once, in a transaction of its own."""
        self._hash.update(data)
        self.size += len(data)
        self._pending += data
        while len(self._pending) >= self.chunk_bytes:
            chunk = bytes(self._pending[: self.chunk_bytes])
            del self._pending[: self.chunk_bytes]
            await self._put(chunk)

    async def _put(self, chunk: bytes) -> None:
        row = {"blob": self.upload, "seq": self._written, "data": chunk}
        await self.store.write(lambda conn: conn.execute(artifact_chunks.insert(), row))
        self._written += 1

    async def finish(self) -> tuple[str, int]:
        """Store the last chunk and name the blob by its hash: ``(sha256, size)``. Content
        stored before (by any run) is kept once; this upload's chunks are then dropped."""
        if self._pending:
            await self._put(bytes(self._pending))
            self._pending.clear()
        digest, size, count, upload = self._hash.hexdigest(), self.size, self._written, self.upload
        blob = {"sha256": digest, "size": size, "chunks": count, "chunk_bytes": self.chunk_bytes}

        def work(conn: Connection) -> None:
            if _touch(conn, digest):
                conn.execute(artifact_chunks.delete().where(artifact_chunks.c.blob == upload))
                return
            conn.execute(artifact_blobs.insert().values(**blob, used_at=time.time()))
            conn.execute(
                artifact_chunks.update().where(artifact_chunks.c.blob == upload).values(blob=digest)
            )

        await _write_once(self.store, work)
        return digest, size

    async def discard(self) -> None:
        """Drop what this upload wrote (a read that failed halfway)."""
        upload = self.upload
        if self._written:
            await self.store.write(
                lambda conn: conn.execute(
                    artifact_chunks.delete().where(artifact_chunks.c.blob == upload)
                )
            )
        self._pending.clear()


def _touch(conn: Connection, digest: str) -> bool:
    """Mark a stored blob used now (pruning spares it); whether it was stored."""
    known = artifact_blobs.update().where(artifact_blobs.c.sha256 == digest)
    return bool(conn.execute(known.values(used_at=time.time())).rowcount)


async def _write_once(store: Store, work: Callable[[Connection], None]) -> None:
    try:
        await store.write(work)
    except IntegrityError:
        # Another replica stored the same content at the same moment: it is kept once,
        # theirs; this time the update finds it.
        await store.write(work)


class ObjectWriter:
    """One blob being written to object storage: the same API as :class:`BlobWriter`;
    bytes go to an upload object in parts, named by their hash at the end."""

    def __init__(self, store: Store, objects: Objects) -> None:
        self.store = store
        self.objects = objects
        self.upload = upload_name()
        self.size = 0
        self._hash = hashlib.sha256()
        self._file: Any = None  # obstore's writer, opened with the first bytes
        self._opened = False

    async def write(self, data: bytes) -> None:
        """Add ``data`` (obstore sends each full part as it fills)."""
        self._hash.update(data)
        self.size += len(data)
        try:
            if self._file is None:
                self._opened, self._file = True, self.objects.upload(self.upload)
            await self._file.write(data)
        except Exception as exc:  # obstore's errors: the bucket did not take it
            raise StorageFailed(f"{type(exc).__name__}: {_first_line(exc)}") from exc

    async def finish(self) -> tuple[str, int]:
        """Complete the upload and name it by its hash: ``(sha256, size)``. Content stored
        before is kept once (the upload is dropped); the blob's row is written only once
        its object is there."""
        digest, size = self._hash.hexdigest(), self.size
        try:
            if self._file is None:  # empty: the object is written all the same (0 bytes)
                self._opened, self._file = True, self.objects.upload(self.upload)
            await self._file.close()
            self._file = None
            stored = await self.store.write(lambda conn: _touch(conn, digest))
            if stored:
                await self.objects.drop(self.upload)
            else:
                await self.objects.keep(self.upload, digest)
        except Exception as exc:
            if is_store_failure(exc):
                raise
            raise StorageFailed(f"{type(exc).__name__}: {_first_line(exc)}") from exc
        if stored:
            return digest, size
        blob = {"sha256": digest, "size": size, "chunks": 0, "chunk_bytes": 0}

        def work(conn: Connection) -> None:
            if not _touch(conn, digest):
                conn.execute(artifact_blobs.insert().values(**blob, used_at=time.time()))

        await _write_once(self.store, work)
        return digest, size

    async def discard(self) -> None:
        """Drop what this upload wrote (a read that failed halfway); a bucket that does
        not answer leaves it to pruning (its name ages it)."""
        file, self._file = self._file, None
        if not self._opened:
            return
        with contextlib.suppress(Exception):
            if file is not None:
                await file.close()  # a multipart upload left open would linger unlisted
        with contextlib.suppress(Exception):
            await self.objects.drop(self.upload)


def _first_line(exc: BaseException) -> str:
    """An obstore error's first line (its service and what failed; never credentials)."""
    return str(exc).splitlines()[0] if str(exc) else ""


_FIELDS = ("name", "size", "sha256", "content_type", "truncated", "skipped")


class Artifacts:
    """Queries on the artifact tables, through the relay's one store."""

    def __init__(self, store: Store, objects: Objects | None = None) -> None:
        self.store = store
        self.objects = objects
        """Where new contents go when RELAY_ARTIFACTS_URL is set (else the store's tables)."""

    def writer(self) -> BlobWriter | ObjectWriter:
        """A new blob's writer (see :class:`BlobWriter`)."""
        if self.objects is not None:
            return ObjectWriter(self.store, self.objects)
        return BlobWriter(self.store)

    async def record(self, run_id: str, entries: Sequence[StoredArtifact]) -> None:
        """Write a run's listing, in order, in one transaction, in place of any written
        before: once per run, but a cancel that cut the first write's answer (written,
        perhaps) has the files kept and listed again (relay/runs/run_task.py)."""
        if not entries:
            return
        rows = [
            {"run_id": run_id, "seq": seq, **{key: getattr(entry, key) for key in _FIELDS}}
            for seq, entry in enumerate(entries)
        ]
        earlier = run_artifacts.delete().where(run_artifacts.c.run_id == run_id)
        owner = sa.select(runs.c.token).where(runs.c.id == run_id)
        kept = sum(entry.size for entry in entries if entry.sha256 is not None)

        def write(conn: Connection) -> None:
            token = conn.scalar(owner)
            if token is not None:  # its token's count: this listing in place of any before
                _count(conn, token, kept - _kept_by(conn, [run_id]).get(run_id, 0))
            conn.execute(earlier)
            conn.execute(run_artifacts.insert(), rows)

        await _write_once(self.store, write)

    async def for_runs(self, run_ids: Sequence[str]) -> dict[str, list[StoredArtifact]]:
        """Each run's listing in order; runs without artifacts are absent."""
        if not run_ids:
            return {}
        query = (
            sa.select(run_artifacts)
            .where(run_artifacts.c.run_id.in_(list(run_ids)))
            .order_by(run_artifacts.c.run_id, run_artifacts.c.seq)
        )
        found: dict[str, list[StoredArtifact]] = {}
        for row in await self.store.read(lambda conn: conn.execute(query).all()):
            values = row._mapping
            found.setdefault(row.run_id, []).append(
                StoredArtifact(**{key: values[key] for key in _FIELDS})
            )
        return found

    async def token_bytes(self, token: str) -> int:
        """The bytes ``token``'s runs' listings keep (their kept entries' sizes), over its
        runs not yet pruned: one lookup by key in ``token_artifacts``."""
        query = sa.select(token_artifacts.c.bytes).where(token_artifacts.c.token == token)
        return int(await self.store.read(lambda conn: conn.scalar(query)) or 0)

    async def find(self, run_id: str, name: str) -> StoredArtifact | None:
        """The run's kept artifact of this name (its first, should a name repeat), or
        ``None`` (no such name, or only a skipped entry)."""
        query = (
            sa.select(run_artifacts)
            .where(
                run_artifacts.c.run_id == run_id,
                run_artifacts.c.name == name,
                run_artifacts.c.sha256.is_not(None),
            )
            .order_by(run_artifacts.c.seq)
            .limit(1)
        )
        row = await self.store.read(lambda conn: conn.execute(query).first())
        if row is None:
            return None
        values = row._mapping
        return StoredArtifact(**{key: values[key] for key in _FIELDS})

    async def blob(self, sha256: str) -> BlobInfo | None:
        """What is stored of a blob, or ``None``."""
        query = sa.select(artifact_blobs).where(artifact_blobs.c.sha256 == sha256)
        row = await self.store.read(lambda conn: conn.execute(query).first())
        if row is None:
            return None
        return BlobInfo(row.sha256, int(row.size), int(row.chunks), int(row.chunk_bytes))

    async def present(self, info: BlobInfo) -> bool:
        """Whether the blob's contents are there to read: a blob in object storage may
        have been deleted from the bucket behind the relay's back (asked before a download
        answers, so that is a clear error, not a stream broken halfway)."""
        if info.chunk_bytes or not info.size:
            return True
        return self.objects is not None and await self.objects.exists(info.sha256)

    async def chunks(
        self, sha256: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """The blob's bytes from ``start`` up to ``end`` (exclusive; ``None``: its end), a
        chunk per query and per item: memory holds one chunk. :class:`BlobMissing` when the
        blob is not stored, or is pruned while being read."""
        info = await self.blob(sha256)
        if info is None:
            raise BlobMissing(sha256)
        end = info.size if end is None else min(end, info.size)
        if start >= end:
            return
        if info.chunk_bytes == 0:  # in object storage (relay/store/objects.py)
            if self.objects is None:
                raise BlobMissing(sha256)  # stored in a bucket this relay is not given
            try:
                async for part in self.objects.read(sha256, start, end):
                    yield part
            except ObjectMissing as exc:
                raise BlobMissing(sha256) from exc
            return
        chunk = info.chunk_bytes
        query = sa.select(artifact_chunks.c.data).where(
            artifact_chunks.c.blob == sha256, artifact_chunks.c.seq == sa.bindparam("seq")
        )

        def read(seq: int) -> Callable[[Connection], bytes | None]:
            return lambda conn: conn.scalar(query, {"seq": seq})

        for seq in range(start // chunk, (end - 1) // chunk + 1):
            data = await self.store.read(read(seq))
            if data is None:
                raise BlobMissing(sha256)
            offset = seq * chunk
            yield bytes(data[max(0, start - offset) : end - offset])


# -- retention (relay/store/retention.py) ----------------------------------------------------


def _kept_by(conn: Connection, run_ids: Sequence[str]) -> dict[str, int]:
    """The bytes each of these runs' listings keep (runs with none are absent)."""
    query = (
        sa.select(run_artifacts.c.run_id, sa.func.sum(run_artifacts.c.size))
        .where(run_artifacts.c.run_id.in_(list(run_ids)), run_artifacts.c.sha256.is_not(None))
        .group_by(run_artifacts.c.run_id)
    )
    return {run_id: int(size or 0) for run_id, size in conn.execute(query).all()}


def _count(conn: Connection, token: str, change: int) -> None:
    """Add ``change`` to the bytes ``token``'s listings keep (its row made at its first)."""
    if change == 0:
        return
    counted = token_artifacts.update().where(token_artifacts.c.token == token)
    # Never below 0: a listing this count never had (one a replica still on schema 12
    # wrote during the upgrade) taken off at its prune would leave the token room past
    # its cap, for good.
    total = token_artifacts.c.bytes + change
    if not conn.execute(counted.values(bytes=sa.case((total < 0, 0), else_=total))).rowcount:
        # Two replicas' first listings of one token at once: one insert fails, and its
        # transaction is written again (``_write_once``), finding the row.
        conn.execute(token_artifacts.insert().values(token=token, bytes=max(change, 0)))


def delete_listings(conn: Connection, tokens: dict[str, str]) -> int:
    """Delete these runs' listings (runs being pruned: run id → its token), their bytes
    taken off their tokens' counts; the entries deleted."""
    if not tokens:
        return 0
    freed: dict[str, int] = {}
    for run_id, size in _kept_by(conn, list(tokens)).items():
        freed[tokens[run_id]] = freed.get(tokens[run_id], 0) + size
    for token, size in sorted(freed.items()):
        _count(conn, token, -size)
    query = run_artifacts.delete().where(run_artifacts.c.run_id.in_(list(tokens)))
    return int(conn.execute(query).rowcount)


def _unused(before: float) -> sa.ColumnElement[bool]:
    named = sa.select(run_artifacts.c.sha256).where(
        run_artifacts.c.sha256 == artifact_blobs.c.sha256
    )
    return sa.and_(artifact_blobs.c.used_at < before, ~named.exists())


def delete_unused_blobs(conn: Connection, before: float, batch: int) -> tuple[int, int, list[str]]:
    """Delete up to ``batch`` blobs no run names, last used before ``before``, with their
    chunks: ``(blobs, bytes, objects)`` deleted, ``objects`` the hashes of those kept in
    object storage (whose objects the caller deletes once this has committed)."""
    found = conn.execute(
        sa.select(artifact_blobs.c.sha256, artifact_blobs.c.size)
        .where(_unused(before))
        .limit(batch)
    ).all()
    if not found:
        return 0, 0, []
    digests = [row.sha256 for row in found]
    # The condition again, in the deleting statement: a run may have named one meanwhile.
    gone = conn.execute(
        artifact_blobs.delete()
        .where(artifact_blobs.c.sha256.in_(digests), _unused(before))
        .returning(artifact_blobs.c.sha256, artifact_blobs.c.size, artifact_blobs.c.chunk_bytes)
    ).all()
    if not gone:
        return 0, 0, []
    deleted = [row.sha256 for row in gone]
    conn.execute(artifact_chunks.delete().where(artifact_chunks.c.blob.in_(deleted)))
    objects = [row.sha256 for row in gone if int(row.chunk_bytes) == 0]
    return len(gone), sum(int(row.size) for row in gone), objects


def delete_abandoned_uploads(conn: Connection, before: float) -> int:
    """Delete the chunks of uploads begun before ``before`` and never finished (a relay
    that died while collecting); the chunks deleted."""
    oldest = f"{UPLOAD_PREFIX}{int(before):010d}"
    query = artifact_chunks.delete().where(
        artifact_chunks.c.blob.startswith(UPLOAD_PREFIX, autoescape=True),
        artifact_chunks.c.blob < oldest,
    )
    return int(conn.execute(query).rowcount)


def unused_after(conn: Connection, before: float, pruned: sa.Select[tuple[str]]) -> tuple[int, int]:
    """What pruning the runs of ``pruned`` (a select of run ids) would free of blobs:
    ``(blobs, bytes)`` no other run names, last used before ``before`` (a dry run's
    figures)."""
    named_elsewhere = sa.select(run_artifacts.c.sha256).where(
        run_artifacts.c.sha256 == artifact_blobs.c.sha256,
        run_artifacts.c.run_id.not_in(pruned),
    )
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(artifact_blobs.c.size), 0)).where(
            artifact_blobs.c.used_at < before, ~named_elsewhere.exists()
        )
    ).one()
    return int(row[0]), int(row[1])
