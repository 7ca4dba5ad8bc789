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
- :meth:`Artifacts.chunks` streams a blob's bytes, or a range of them, one chunk per query:
  a download holds one chunk in memory, whatever the size. A blob pruned meanwhile raises
  :class:`BlobMissing`.

Retention (relay/store/retention.py) deletes a pruned run's listing with it, then the blobs
no listing names whose ``used_at`` is older than its cutoff (a blob is touched whenever a
run stores it anew, so one a run is naming right now is never deleted), then uploads
abandoned before the cutoff.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from relay.store.database import Store
from relay.store.schema import artifact_blobs, artifact_chunks, run_artifacts

CHUNK_BYTES = 256 * 1024
"""Bytes per chunk row: small enough to hold one per download, large enough that a 16 MiB
artifact is 64 rows."""
UPLOAD_PREFIX = "up_"
"""Starts the name an upload's chunks carry until it is finished: ``up_<10-digit unix
time>_<hex>``, so what a relay died writing is found, and aged, by its name alone."""


class BlobMissing(LookupError):
    """The blob is not (or no longer) stored: pruned, or never finished."""


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
            now = time.time()
            known = artifact_blobs.update().where(artifact_blobs.c.sha256 == digest)
            if conn.execute(known.values(used_at=now)).rowcount:
                conn.execute(artifact_chunks.delete().where(artifact_chunks.c.blob == upload))
                return
            conn.execute(artifact_blobs.insert().values(**blob, used_at=now))
            conn.execute(
                artifact_chunks.update().where(artifact_chunks.c.blob == upload).values(blob=digest)
            )

        try:
            await self.store.write(work)
        except IntegrityError:
            # Another replica stored the same content at the same moment: it is kept
            # once, theirs; this time the update finds it.
            await self.store.write(work)
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


_FIELDS = ("name", "size", "sha256", "content_type", "truncated", "skipped")


class Artifacts:
    """Queries on the artifact tables, through the relay's one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def writer(self) -> BlobWriter:
        """A new blob's writer (see :class:`BlobWriter`)."""
        return BlobWriter(self.store)

    async def record(self, run_id: str, entries: Sequence[StoredArtifact]) -> None:
        """Write a run's listing, in order, in one transaction (written once per run)."""
        if not entries:
            return
        rows = [
            {"run_id": run_id, "seq": seq, **{key: getattr(entry, key) for key in _FIELDS}}
            for seq, entry in enumerate(entries)
        ]
        await self.store.write(lambda conn: conn.execute(run_artifacts.insert(), rows))

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


def delete_listings(conn: Connection, run_ids: Sequence[str]) -> int:
    """Delete these runs' listings (runs being pruned); the entries deleted."""
    if not run_ids:
        return 0
    query = run_artifacts.delete().where(run_artifacts.c.run_id.in_(list(run_ids)))
    return int(conn.execute(query).rowcount)


def _unused(before: float) -> sa.ColumnElement[bool]:
    named = sa.select(run_artifacts.c.sha256).where(
        run_artifacts.c.sha256 == artifact_blobs.c.sha256
    )
    return sa.and_(artifact_blobs.c.used_at < before, ~named.exists())


def delete_unused_blobs(conn: Connection, before: float, batch: int) -> tuple[int, int]:
    """Delete up to ``batch`` blobs no run names, last used before ``before``, with their
    chunks: ``(blobs, bytes)`` deleted."""
    found = conn.execute(
        sa.select(artifact_blobs.c.sha256, artifact_blobs.c.size)
        .where(_unused(before))
        .limit(batch)
    ).all()
    if not found:
        return 0, 0
    digests = [row.sha256 for row in found]
    # The condition again, in the deleting statement: a run may have named one meanwhile.
    gone = conn.execute(
        artifact_blobs.delete()
        .where(artifact_blobs.c.sha256.in_(digests), _unused(before))
        .returning(artifact_blobs.c.sha256, artifact_blobs.c.size)
    ).all()
    if not gone:
        return 0, 0
    deleted = [row.sha256 for row in gone]
    conn.execute(artifact_chunks.delete().where(artifact_chunks.c.blob.in_(deleted)))
    return len(gone), sum(int(row.size) for row in gone)


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
