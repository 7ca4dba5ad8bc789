"""Artifacts' contents in object storage (RELAY_ARTIFACTS_URL), through obstore.

With the setting unset the store's own tables keep every artifact (relay/store/artifacts.py);
set, the contents go to S3, GCS, Azure or a local folder instead, one object per distinct
content named ``<prefix>/<sha256>``, while the listings and the blobs' rows (size, when last
used) stay in the store, so every replica sees the same. A blob whose row says
``chunk_bytes == 0`` lives here; one stored in the tables before the setting was set is
still read from there.

An upload is written to ``<prefix>/uploads/up_<unix time>_<hex>`` (obstore's writer sends
it in parts of :data:`PART_BYTES`, so memory holds at most one part), then copied to its
hash's name and the upload deleted; the blob's row is written only after the copy, so no
listing names an object that was never stored. A relay that died mid-upload leaves the
upload, pruned by its name's time like the store's own. Credentials and endpoints come from
the variables obstore reads for each service (AWS_*, GOOGLE_*, AZURE_*); they are never
printed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from relay.errors import ConfigError
from relay.settings import Settings

if TYPE_CHECKING:
    from obstore import AsyncWritableFile
    from obstore.store import ObjectStore

PART_BYTES = 5 * 1_048_576
"""The writer's buffer: each full one is a part of a multipart upload (S3's least part)."""
READ_BYTES = 256 * 1024
"""The least bytes a download's read yields at a time (the store's own chunk size)."""
UPLOADS = "uploads/"
"""Where uploads not yet named by their hash are written (``uploads/up_<time>_<hex>``)."""
SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "file", "memory")
"""The URL schemes obstore's ``from_url`` opens; anything else is refused at start."""


class StorageFailed(Exception):
    """The bucket did not take an upload (unreachable, refused, gone): the file is listed
    as skipped, the run's result kept (relay/runs/artifacts.py)."""


class ObjectMissing(LookupError):
    """The object is not in the bucket (deleted behind the relay's back, or never written)."""


def _redacted(url: str) -> str:
    """The URL without anything before an ``@`` (user and password never printed)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


class Objects:
    """One bucket (and prefix) that artifacts' contents are kept in."""

    def __init__(self, store: ObjectStore, url: str) -> None:
        self.store = store
        self.url = _redacted(url)

    @classmethod
    async def open(
        cls, url: str, config: Mapping[str, Any] | None = None, endpoint: str | None = None
    ) -> Objects:
        """Open ``url`` and check that it answers (a listing of the uploads' prefix); a
        :class:`ConfigError` naming RELAY_ARTIFACTS_URL when it is not usable. ``config``
        is obstore's per-service options (``aws_…`` keys); ``endpoint`` an S3-compatible
        service's URL (RELAY_ARTIFACTS_ENDPOINT: MinIO, R2, a local test server), plain
        HTTP allowed when it says ``http://``."""
        shown = _redacted(url)
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in SCHEMES:
            raise ConfigError(
                f"RELAY_ARTIFACTS_URL {shown!r}: not an object storage URL "
                f"(use s3://, gs://, az:// or file://)"
            )
        try:
            import obstore
            from obstore.store import LocalStore, from_url
        except ImportError as exc:
            raise ConfigError(
                "RELAY_ARTIFACTS_URL is set but obstore is not installed "
                "(pip install 'sandbox-relay[objects]')"
            ) from exc
        try:
            if scheme == "file":
                # A folder the relay creates, as it does the SQLite file's.
                store: ObjectStore = LocalStore.from_url(url, mkdir=True)
            else:
                options = dict(config or {})
                if endpoint:
                    options["aws_endpoint"] = endpoint
                client = {"allow_http": True} if endpoint and endpoint.startswith("http:") else None
                store = from_url(url, config=options or None, client_options=client)  # type: ignore[arg-type]
            async for _ in obstore.list(store, prefix=UPLOADS, chunk_size=1):
                break  # one answer is all the check needs
        except BaseException as exc:  # obstore's errors name the service, never the secrets
            # A bad option is a Rust panic in obstore (pyo3's PanicException, a
            # BaseException): a start error like any other, not a crash.
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            raise ConfigError(
                f"RELAY_ARTIFACTS_URL {shown!r} is not usable: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        return cls(store, url)

    def upload(self, name: str) -> AsyncWritableFile:
        """A writer for the upload ``name`` (under :data:`UPLOADS`), in parts."""
        import obstore

        return obstore.open_writer_async(self.store, UPLOADS + name, buffer_size=PART_BYTES)

    async def keep(self, name: str, sha256: str) -> None:
        """Name the finished upload by its hash (a copy; the same content twice is the
        same object), then delete the upload."""
        import obstore

        await obstore.copy_async(self.store, UPLOADS + name, sha256, overwrite=True)
        await self.drop(name)

    async def drop(self, name: str) -> None:
        """Delete the upload ``name``, if it was written at all."""
        await self.delete([UPLOADS + name])

    async def delete(self, paths: list[str]) -> None:
        """Delete these objects; one already gone is no error."""
        import obstore
        from obstore.exceptions import NotFoundError

        for path in paths:
            with contextlib.suppress(NotFoundError):
                await obstore.delete_async(self.store, path)

    async def exists(self, sha256: str) -> bool:
        """Whether the object ``sha256`` is in the bucket."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            await obstore.head_async(self.store, sha256)
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    async def read(self, sha256: str, start: int, end: int) -> AsyncIterator[bytes]:
        """The bytes ``start`` to ``end`` (exclusive) of the object ``sha256``, streamed as
        the service sends them; :class:`ObjectMissing` when it is not there."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            result = await obstore.get_async(self.store, sha256, options={"range": (start, end)})
        except (NotFoundError, FileNotFoundError) as exc:
            raise ObjectMissing(sha256) from exc
        async for part in result.stream(min_chunk_size=READ_BYTES):
            yield bytes(part)

    async def delete_uploads(self, before: float) -> int:
        """Delete the uploads begun before ``before`` and never finished; how many."""
        import obstore

        oldest = f"up_{int(before):010d}"
        stale: list[str] = []
        async for batch in obstore.list(self.store, prefix=UPLOADS):
            stale += [
                meta["path"]
                for meta in batch
                if meta["path"].removeprefix(UPLOADS).startswith("up_")
                and meta["path"].removeprefix(UPLOADS) < oldest
            ]
        await self.delete(stale)
        return len(stale)

    async def names(self) -> list[str]:
        """Every object's name (tests and checks; a bucket of artifacts is small)."""
        import obstore

        found: list[str] = []
        async for batch in obstore.list(self.store):
            found += [meta["path"] for meta in batch]
        return found


async def open_objects(settings: Settings) -> Objects | None:
    """The bucket RELAY_ARTIFACTS_URL names, checked; ``None`` when it is unset."""
    if not settings.artifacts_url:
        return None
    return await Objects.open(settings.artifacts_url, endpoint=settings.artifacts_endpoint)


def upload_name() -> str:
    """A fresh upload's name: ``up_<10-digit unix time>_<hex>`` (aged by name alone)."""
    import secrets

    return f"up_{int(time.time()):010d}_{secrets.token_hex(8)}"
