"""Modal Sandboxes through the official ``modal`` client (pinned in the ``modal`` extra).

One ``modal.Client`` per relay, built from the settings (never from ``MODAL_*`` variables or
``~/.modal.toml`` credentials), and one App (``RELAY_MODAL_APP``) that owns every sandbox.
A run is: ``Sandbox.create`` with no entrypoint (it idles until its own ``timeout``), files
written with the client's filesystem API, the job as one ``exec`` whose stdout and stderr
stream into the :class:`OutputSink`, then ``terminate``. See ``docs/providers/modal.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import posixpath
import stat
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

import anyio
import modal
import modal.config
import modal.exception as modal_errors
from modal_proto import api_pb2
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict

from relay.cancellation import shielded
from relay.errors import (
    ConfigError,
    FileUnreadable,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.contract import (
    DEFAULT_WORKDIR,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    FileEntry,
    FileKind,
    OutputSink,
    Rate,
    SandboxRef,
    SandboxSpec,
    StreamName,
)
from relay.providers.lifecycle import TIMEOUT_MARGIN_S, ErrorTable, ProviderSandbox, SandboxProvider
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.modal")

MAX_LIFETIME_S = 24 * 3600
"""Modal's ceiling on a sandbox ``timeout``."""
MIN_CPU, MAX_CPU = 0.125, 64.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 128, 256 * 1024
STDIN_CHUNK = 1024 * 1024
TAG_CREATED = "relay-created"
"""Tag holding the sandbox's creation time (Unix seconds): the API's ``SandboxInfo`` has a
``created_at``, but the client's ``Sandbox.list`` drops it, so the relay tags its own."""

ERRORS: ErrorTable = (
    ((modal_errors.AuthError, modal_errors.PermissionDeniedError), ProviderAuth),
    (modal_errors.ResourceExhaustedError, ProviderRateLimited),
    (
        (
            modal_errors.NotFoundError,
            modal_errors.ConflictError,
            modal_errors.SandboxTerminatedError,
            modal_errors.SandboxTimeoutError,
            modal_errors.ClientClosed,
        ),
        SandboxLost,
    ),
    (
        (
            modal_errors.ServiceError,
            modal_errors.InternalError,
            modal_errors.ConnectionError,
            modal_errors.TimeoutError,
            modal_errors.UnimplementedError,
            ConnectionError,
            OSError,
        ),
        ProviderUnavailable,
    ),
)


class ModalSandbox(ProviderSandbox):
    """One live Modal sandbox, valid inside :meth:`ModalProvider.sandbox`.

    Its files are read through the client's filesystem API (modal 1.6.4):
    ``filesystem.list_files`` (a link is ``symlink``; a special file is a ``file`` whose
    ``mode`` says otherwise) and ``filesystem.read_bytes`` for a file within the cap. That
    call reads a whole file, so a larger one (or one of unknown size) is read with
    ``exec("head", "-c", cap)`` instead, its stdout streamed and left at the cap.
    """

    def __init__(self, provider: ModalProvider, handle: Any) -> None:
        super().__init__(provider, handle.object_id)
        self.handle = handle
        self._directories: set[str] = set()

    async def folder_entries(self, path: str) -> list[FileEntry]:
        try:
            listed = await self.handle.filesystem.list_files.aio(path)
        except _MISSING as exc:
            raise FileUnreadable("no such folder") from exc
        return [FileEntry(info.name, _kind(info), info.size) for info in listed]

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        if size is not None and size <= limit:
            try:
                yield await self.handle.filesystem.read_bytes.aio(path)
            except (*_MISSING, modal_errors.SandboxFilesystemFileTooLargeError) as exc:
                raise FileUnreadable("the file could not be read") from exc
            return
        folder, name = posixpath.split(path)
        process = await self.handle.exec.aio(
            "head", "-c", str(limit), "--", name, workdir=folder, text=False
        )
        read = 0
        async for chunk in process.stdout:
            yield chunk
            read += len(chunk)
            if read >= limit:
                return  # head ends by itself at the cap
        if not read and await process.wait.aio() != 0:
            raise FileUnreadable("the file could not be read")

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        for path, data in files.items():
            target = posixpath.join(DEFAULT_WORKDIR, path)  # an absolute path stays as is
            await self.handle.filesystem.write_bytes.aio(data, target)
            parent = posixpath.dirname(target)  # write_bytes made it and its parents
            while parent not in self._directories and parent != "/":
                self._directories.add(parent)
                parent = posixpath.dirname(parent)

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        # a relative workdir is relative to the default one, like upload paths
        workdir = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, workdir or "."))
        if workdir not in self._directories:  # a registry image may not have it
            await self.handle.filesystem.make_directory.aio(workdir)
            self._directories.add(workdir)
        # argv goes over gRPC as a list (no shell anywhere); env travels as an inline
        # secret, never in argv; the timeout is only a second line of defence, set a
        # little past the caller's deadline so that one fires first (a timed-out run).
        process = await self.handle.exec.aio(
            *argv,
            workdir=workdir,
            env=dict(env),
            timeout=math.ceil(timeout_s + TIMEOUT_MARGIN_S),
            text=False,
        )
        async with anyio.create_task_group() as group:
            group.start_soon(_pump, process.stdout, "stdout", output)
            group.start_soon(_pump, process.stderr, "stderr", output)
            await _send_stdin(process, stdin or b"")
        code: int = await process.wait.aio()
        # -1 is the client's "its own deadline passed"; the exit status is then unknown.
        return ExecResult(exit_code=None if code == -1 else code)


_MISSING = (
    modal_errors.SandboxFilesystemNotFoundError,
    modal_errors.SandboxFilesystemNotADirectoryError,
    modal_errors.SandboxFilesystemIsADirectoryError,
    modal_errors.SandboxFilesystemPermissionError,
)
"""What the filesystem API raises for a path it will not read as asked (not an outage)."""


def _kind(info: Any) -> FileKind:
    """A listed entry's kind: its ``mode`` (the whole ``st_mode``) tells a FIFO or device
    the listing calls a ``file`` from a regular file."""
    kinds: dict[str, FileKind] = {"file": "file", "directory": "folder", "symlink": "link"}
    kind = kinds.get(getattr(info.type, "value", ""), "other")
    if kind == "file" and stat.S_IFMT(info.mode) and not stat.S_ISREG(info.mode):
        return "other"
    return kind


def _created_at(tags: Mapping[str, str]) -> datetime | None:
    """The creation time the relay tagged the sandbox with (none on one made elsewhere)."""
    try:
        return datetime.fromtimestamp(int(tags[TAG_CREATED]), UTC)
    except (KeyError, ValueError, OverflowError):
        return None


async def _pump(reader: Any, stream: StreamName, output: OutputSink) -> None:
    async for chunk in reader:
        output.write(stream, chunk)


async def _send_stdin(process: Any, data: bytes) -> None:
    # Always close stdin, even when empty: a job reading stdin must see EOF, not hang.
    for start in range(0, len(data), STDIN_CHUNK):
        process.stdin.write(data[start : start + STDIN_CHUNK])
        await process.stdin.drain.aio()
    process.stdin.write_eof()
    await process.stdin.drain.aio()


class ModalSettings(ProviderSettings):
    """``RELAY_MODAL_*``: the token pair, the App that owns every sandbox, and overrides."""

    model_config = SettingsConfigDict(env_prefix="RELAY_MODAL_")

    token_id: SecretStr | None = None
    token_secret: SecretStr | None = None
    app: str = "relay"
    server_url: str | None = None
    environment: str | None = None


class ModalProvider(SandboxProvider[ModalSandbox]):
    """Runs jobs as Modal Sandboxes in the App ``RELAY_MODAL_APP``."""

    name: ClassVar[str] = "modal"
    label: ClassVar[str] = "Modal"
    rate: ClassVar[Rate] = Rate(0.00003942, 0.00000667)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = ModalSettings
    retry_after_s: ClassVar[float] = 10.0
    """Modal's throttling errors carry no delay the client exposes; this is our suggestion."""
    terminate_timeout_s: ClassVar[float] = 20.0
    """Bound on one terminate (the client retries transient failures inside it)."""

    def __init__(self, settings: Settings) -> None:
        self._config = settings.section(ModalSettings)
        token_id, token_secret = self._config.token_id, self._config.token_secret
        if token_id is None or token_secret is None:
            # Modal's own credentials (~/.modal.toml, MODAL_TOKEN_*) are never read: without
            # these every create would fail, so the relay does not start.
            raise ConfigError(
                "the modal provider needs RELAY_MODAL_TOKEN_ID and RELAY_MODAL_TOKEN_SECRET"
            )
        self._credentials = (token_id, token_secret)
        self._cluster = settings.cluster
        self.create_timeout_s = settings.create_timeout_s
        self._client: Any = None
        self._app: Any = None
        self._lock = anyio.Lock()
        self._handles: dict[str, Any] = {}
        """The handle of each sandbox this relay created and has not terminated yet."""

    # -- checks ------------------------------------------------------------------------------

    def check(self, spec: SandboxSpec) -> None:
        if not (spec.egress.none or spec.egress.open):
            spec.egress.cidrs(self.name)  # host names raise EgressUnsupported
        cpu, memory = spec.resources.cpu, spec.resources.memory_mb
        if not MIN_CPU <= cpu <= MAX_CPU:
            raise SizeUnsupported(f"Modal sandboxes take {MIN_CPU} to {MAX_CPU:g} CPUs")
        if not MIN_MEMORY_MB <= memory <= MAX_MEMORY_MB:
            raise SizeUnsupported(f"Modal sandboxes take {MIN_MEMORY_MB} to {MAX_MEMORY_MB} MiB")
        if spec.lifetime_s > MAX_LIFETIME_S:
            raise ValidationFailed("a Modal sandbox lives at most 24 hours (timeout plus grace)")

    @staticmethod
    def create_options(spec: SandboxSpec) -> dict[str, Any]:
        """The ``Sandbox.create`` arguments for a spec (no client objects: testable alone)."""
        options: dict[str, Any] = {
            "timeout": spec.lifetime_s,
            "cpu": spec.resources.cpu,
            "memory": spec.resources.memory_mb,
            "tags": {**spec.tags, TAG_CREATED: str(int(time.time()))},
        }
        if spec.egress.none:
            options["block_network"] = True
        elif not spec.egress.open:
            options["outbound_cidr_allowlist"] = spec.egress.cidrs("modal")
        return options

    @staticmethod
    def image_for(spec: SandboxSpec) -> Any:
        image = modal.Image.from_registry(spec.image) if spec.image else modal.Image.debian_slim()
        if spec.pip:
            image = image.pip_install(*spec.pip)
        return image

    # -- client --------------------------------------------------------------------------------

    async def _connected(self) -> tuple[Any, Any]:
        """The client and App, built once from the settings (credentials passed explicitly)."""
        async with self._lock:
            if self._client is None:
                token_id, token_secret = self._credentials
                server_url = self._config.server_url or modal.config.DEFAULT_SERVER_URL
                credentials = (token_id.get_secret_value(), token_secret.get_secret_value())
                client: Any = modal.Client(server_url, api_pb2.CLIENT_TYPE_CLIENT, credentials)
                try:
                    await client.__aenter__()
                except BaseException:
                    # No half-open client left behind, nor the create held past its bound by
                    # a close that never ends; the first error is the one raised.
                    with contextlib.suppress(Exception):
                        closing = client.close.aio()
                        await shielded(asyncio.wait_for(closing, self.terminate_timeout_s))
                    raise
                self._client = client
            if self._app is None:
                try:
                    self._app = await modal.App.lookup.aio(
                        self._config.app,
                        client=self._client,
                        environment_name=self._config.environment,
                        create_if_missing=True,
                    )
                except Exception as exc:
                    raise self.mapped(exc, "looking up the Modal app", in_sandbox=False) from exc
            return self._client, self._app

    # -- the driver ------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> ModalSandbox:
        client, app = await self._connected()
        handle = await modal.Sandbox.create.aio(
            app=app, client=client, image=self.image_for(spec), **self.create_options(spec)
        )
        self._handles[handle.object_id] = handle
        return ModalSandbox(self, handle)

    def create_timed_out(self) -> ProviderError:
        if self._app is None:
            # The client retries its first connection for about a minute, so a Modal
            # that cannot be reached at all shows up here, as a timeout.
            return ProviderUnavailable("Modal could not be reached")
        error: ProviderError = super().create_timed_out()
        return error

    def may_have_created(self, error: ProviderError) -> bool:
        # Without an App no create was ever sent (and a sweep would wait on the client).
        return self._app is not None and super().may_have_created(error)

    async def destroy(self, sandbox_id: str) -> None:
        handle: Any = self._handles.pop(sandbox_id, None)
        if handle is None:
            client, _ = await self._connected()
            handle = await modal.Sandbox.from_id.aio(sandbox_id, client=client)
        try:
            await handle.terminate.aio()
        finally:
            # Release the router connection, bounded (the terminate's own bound is the base's).
            with anyio.move_on_after(self.terminate_timeout_s), contextlib.suppress(Exception):
                await handle.detach.aio()

    async def list_tagged(self) -> list[SandboxRef]:
        client, app = await self._connected()
        refs: list[SandboxRef] = []
        wanted = {TAG_CLUSTER: self._cluster}
        async for handle in modal.Sandbox.list.aio(app_id=app.app_id, tags=wanted, client=client):
            try:
                tags: dict[str, str] = await handle.get_tags.aio()
            except modal_errors.NotFoundError:
                continue  # ended between the listing and this call: nothing to reap
            refs.append(
                SandboxRef(handle.object_id, tags.get(TAG_RUN), created_at=_created_at(tags))
            )
        return refs

    async def aclose(self) -> None:
        client, self._client, self._app = self._client, None, None
        if client is not None:
            await client.close.aio()
