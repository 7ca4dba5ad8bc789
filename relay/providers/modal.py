"""Modal Sandboxes through the official ``modal`` client (pinned in the ``modal`` extra).

One ``modal.Client`` per relay, built from the settings (never from ``MODAL_*`` variables or
``~/.modal.toml`` credentials), and one App (``RELAY_MODAL_APP``) that owns every sandbox.
A run is: ``Sandbox.create`` with no entrypoint (it idles until its own ``timeout``), files
written with the client's filesystem API, the job as one ``exec`` whose stdout and stderr
stream into the :class:`OutputSink`, then ``terminate``. See ``docs/providers/modal.md``.
"""

from __future__ import annotations

import logging
import math
import posixpath
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, ClassVar

import anyio
import modal
import modal.config
import modal.exception as modal_errors
from modal_proto import api_pb2

from relay.errors import (
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.base import (
    DEFAULT_WORKDIR,
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    OutputSink,
    SandboxRef,
    SandboxSpec,
    StreamName,
    shielded,
)
from relay.settings import Settings

log = logging.getLogger("relay.providers.modal")

MAX_LIFETIME_S = 24 * 3600
"""Modal's ceiling on a sandbox ``timeout``."""
MIN_CPU, MAX_CPU = 0.125, 64.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 128, 256 * 1024
TERMINATE_TIMEOUT_S = 20.0
"""Bound on one terminate (the client retries transient failures inside it)."""
SWEEP_TIMEOUT_S = 10.0
RATE_LIMIT_RETRY_S = 10.0
"""Modal's throttling errors carry no delay the client exposes; this is our suggestion."""
STDIN_CHUNK = 1024 * 1024
EXEC_TIMEOUT_MARGIN_S = 2
TAG_CREATED = "relay-created"
"""Tag holding the sandbox's creation time (Unix seconds): the API's ``SandboxInfo`` has a
``created_at``, but the client's ``Sandbox.list`` drops it, so the relay tags its own."""

_LOST = (
    modal_errors.NotFoundError,
    modal_errors.ConflictError,
    modal_errors.SandboxTerminatedError,
    modal_errors.SandboxTimeoutError,
    modal_errors.ClientClosed,
)
_UNAVAILABLE = (
    modal_errors.ServiceError,
    modal_errors.InternalError,
    modal_errors.ConnectionError,
    modal_errors.TimeoutError,
    modal_errors.UnimplementedError,
    ConnectionError,
    OSError,
)


def map_error(exc: BaseException, action: str, *, in_sandbox: bool = False) -> ProviderError:
    """One place that turns a client exception into a relay error, with our own words only."""
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, modal_errors.AuthError | modal_errors.PermissionDeniedError):
        return ProviderAuth(f"Modal refused the relay's credentials while {action}")
    if isinstance(exc, modal_errors.ResourceExhaustedError):
        return ProviderRateLimited(
            f"Modal is rate limiting the relay ({action})", retry_after=RATE_LIMIT_RETRY_S
        )
    if in_sandbox and isinstance(exc, _LOST):
        return SandboxLost(f"the Modal sandbox went away while {action}")
    if isinstance(exc, _UNAVAILABLE):
        return ProviderUnavailable(f"Modal is unavailable ({action})")
    return ProviderError(f"Modal failed while {action} ({type(exc).__name__})")


class ModalSandbox:
    """One live Modal sandbox, valid inside :meth:`ModalProvider.sandbox`."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.id: str = handle.object_id
        self._directories: set[str] = set()

    async def upload(self, files: Mapping[str, bytes]) -> None:
        try:
            for path, data in files.items():
                target = posixpath.join(DEFAULT_WORKDIR, path)  # an absolute path stays as is
                await self._handle.filesystem.write_bytes.aio(data, target)
                parent = posixpath.dirname(target)  # write_bytes made it and its parents
                while parent not in self._directories and parent != "/":
                    self._directories.add(parent)
                    parent = posixpath.dirname(parent)
        except Exception as exc:
            raise map_error(exc, "uploading files", in_sandbox=True) from exc

    async def exec(
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
        try:
            if workdir not in self._directories:  # a registry image may not have it
                await self._handle.filesystem.make_directory.aio(workdir)
                self._directories.add(workdir)
            # argv goes over gRPC as a list (no shell anywhere); env travels as an inline
            # secret, never in argv; the timeout is only a second line of defence, set a
            # little past the caller's deadline so that one fires first (a timed-out run).
            process = await self._handle.exec.aio(
                *argv,
                workdir=workdir,
                env=dict(env),
                timeout=math.ceil(timeout_s) + EXEC_TIMEOUT_MARGIN_S,
                text=False,
            )
            async with anyio.create_task_group() as group:
                group.start_soon(_pump, process.stdout, "stdout", output)
                group.start_soon(_pump, process.stderr, "stderr", output)
                await _send_stdin(process, stdin or b"")
            code: int = await process.wait.aio()
        except Exception as exc:
            raise map_error(exc, "running the command", in_sandbox=True) from exc
        # -1 is the client's "its own deadline passed"; the exit status is then unknown.
        return ExecResult(exit_code=None if code == -1 else code)


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


class ModalProvider:
    """Runs jobs as Modal Sandboxes in the App ``settings.modal_app``."""

    name: ClassVar[str] = "modal"

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._client: Any = None
        self._app: Any = None
        self._lock = anyio.Lock()

    # -- checks and mapping ------------------------------------------------------------------

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
            "env": dict(spec.env),  # sent as an inline secret, not on a command line
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
                token_id = self._settings.modal_token_id
                token_secret = self._settings.modal_token_secret
                if token_id is None or token_secret is None:
                    raise ProviderAuth(
                        "RELAY_MODAL_TOKEN_ID and RELAY_MODAL_TOKEN_SECRET are unset"
                    )
                server_url = self._settings.modal_server_url or modal.config.DEFAULT_SERVER_URL
                credentials = (token_id.get_secret_value(), token_secret.get_secret_value())
                client: Any = modal.Client(server_url, api_pb2.CLIENT_TYPE_CLIENT, credentials)
                try:
                    await client.__aenter__()
                except BaseException:
                    await shielded(client.close.aio())  # no half-open client left behind
                    raise
                self._client = client
            if self._app is None:
                try:
                    self._app = await modal.App.lookup.aio(
                        self._settings.modal_app,
                        client=self._client,
                        environment_name=self._settings.modal_environment,
                        create_if_missing=True,
                    )
                except Exception as exc:
                    raise map_error(exc, "looking up the Modal app") from exc
            return self._client, self._app

    # -- the contract ----------------------------------------------------------------------------

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[ModalSandbox]:
        self.check(spec)
        handle = await self._create(spec)
        box = ModalSandbox(handle)
        try:
            yield box
        except BaseException:
            # The original error is what the caller needs; a failed terminate is only logged
            # here (the reaper finds the sandbox by its tags and retries).
            await self._finish(handle, raise_errors=False)
            raise
        await self._finish(handle, raise_errors=True)

    async def _create(self, spec: SandboxSpec) -> Any:
        try:
            with anyio.fail_after(self._settings.create_timeout_s):
                client, app = await self._connected()
                return await modal.Sandbox.create.aio(
                    app=app, client=client, image=self.image_for(spec), **self.create_options(spec)
                )
        except TimeoutError as exc:
            if self._app is None:
                # The client retries its first connection for about a minute, so a Modal
                # that cannot be reached at all shows up here, as a timeout.
                raise ProviderUnavailable("Modal could not be reached") from exc
            await self._sweep(spec)
            raise ProviderTimeout("Modal did not create the sandbox in time") from exc
        except ProviderError:
            raise
        except anyio.get_cancelled_exc_class():
            await self._sweep(spec)  # the caller gave up mid-create; leave nothing behind
            raise
        except Exception as exc:
            error = map_error(exc, "creating a sandbox")
            if not isinstance(error, ProviderAuth | ProviderRateLimited):
                await self._sweep(spec)  # the create may have landed even though it failed
            raise error from exc

    async def _sweep(self, spec: SandboxSpec) -> None:
        """Terminate whatever a failed create left tagged with this run (best effort)."""
        await shielded(self._sweep_now(spec))

    async def _sweep_now(self, spec: SandboxSpec) -> None:
        with anyio.move_on_after(SWEEP_TIMEOUT_S):
            try:
                client, app = await self._connected()
                found = modal.Sandbox.list.aio(app_id=app.app_id, tags=spec.tags, client=client)
                async for handle in found:
                    log.warning(
                        "modal sandbox %s: terminating after a failed create", handle.object_id
                    )
                    await handle.terminate.aio()
            except Exception as exc:
                log.warning("modal sweep for run %s failed (%s)", spec.run_id, type(exc).__name__)

    async def _finish(self, handle: Any, *, raise_errors: bool) -> None:
        sandbox_id = handle.object_id
        error = await shielded(self._terminate_handle(handle))
        if error is not None:
            log.error("modal sandbox %s: terminate failed (%s)", sandbox_id, type(error).__name__)
            if raise_errors:
                raise map_error(error, "terminating the sandbox") from error

    @staticmethod
    async def _terminate_handle(handle: Any) -> Exception | None:
        """Terminate (bounded) and release the router connection; the error, if any."""
        error: Exception | None = None
        try:
            with anyio.fail_after(TERMINATE_TIMEOUT_S):
                await handle.terminate.aio()
        except modal_errors.NotFoundError:
            pass  # already gone: that is what we wanted
        except Exception as exc:
            error = exc
        try:
            with anyio.move_on_after(TERMINATE_TIMEOUT_S):
                await handle.detach.aio()
        except Exception as exc:
            log.debug("modal sandbox %s: detach failed (%s)", handle.object_id, type(exc).__name__)
        return error

    async def list_owned(self) -> list[SandboxRef]:
        try:
            client, app = await self._connected()
            refs: list[SandboxRef] = []
            wanted = {TAG_CLUSTER: self._settings.cluster}
            async for handle in modal.Sandbox.list.aio(
                app_id=app.app_id, tags=wanted, client=client
            ):
                try:
                    tags: dict[str, str] = await handle.get_tags.aio()
                except modal_errors.NotFoundError:
                    continue  # ended between the listing and this call: nothing to reap
                refs.append(
                    SandboxRef(handle.object_id, tags.get(TAG_RUN), created_at=_created_at(tags))
                )
            return refs
        except ProviderError:
            raise
        except Exception as exc:
            raise map_error(exc, "listing sandboxes") from exc

    async def terminate(self, sandbox_id: str) -> None:
        try:
            client, _ = await self._connected()
            with anyio.fail_after(TERMINATE_TIMEOUT_S):
                handle: Any = await modal.Sandbox.from_id.aio(sandbox_id, client=client)
                await handle.terminate.aio()
            await handle.detach.aio()
        except modal_errors.NotFoundError:
            return
        except ProviderError:
            raise
        except TimeoutError as exc:
            log.error("modal sandbox %s: terminate timed out", sandbox_id)
            raise ProviderTimeout("Modal did not terminate the sandbox in time") from exc
        except Exception as exc:
            log.error("modal sandbox %s: terminate failed (%s)", sandbox_id, type(exc).__name__)
            raise map_error(exc, "terminating a sandbox") from exc

    async def aclose(self) -> None:
        client, self._client, self._app = self._client, None, None
        if client is not None:
            await client.close.aio()
