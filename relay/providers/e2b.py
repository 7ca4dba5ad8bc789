"""E2B provider: one Firecracker sandbox per run, through the ``e2b`` SDK (``AsyncSandbox``).

Mapping (see docs/providers/e2b.md):

* image -> template (``spec.image`` or ``RELAY_E2B_TEMPLATE``); size is fixed by the
  template, so only the default size is accepted;
* ``spec.lifetime_s`` -> the sandbox ``timeout`` (E2B kills it then, relay or not);
* ``spec.tags`` -> sandbox ``metadata`` (``list_owned`` filters on the cluster tag);
* each create carries its own ``Idempotency-Key``: the SDK retries a create answered
  429/502/503/504, and a retry then returns the sandbox a lost answer made;
* egress ``()`` -> ``allow_internet_access=False``; a host list -> ``network.allowOut``
  with ``denyOut 0.0.0.0/0``; ``("*",)`` -> open.

Commands run as ``root`` (E2B's default user cannot create ``/workspace``; the VM is the
isolation boundary). The SDK's own command timeout does not fire on Python 3.11, so the
relay's cancellation is the deadline: on cancel we SIGKILL the command, and leaving the
sandbox context kills the sandbox.
"""

from __future__ import annotations

import ipaddress
import logging
import posixpath
import secrets
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import suppress
from typing import Any, ClassVar, NoReturn

import anyio
import httpx
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileType,
    RateLimitException,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)
from e2b.exceptions import (
    FileNotFoundException,
    NotFoundException,
    SandboxNotRunningException,
    SandboxUnreachableException,
    ServiceBusyException,
)
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict

from relay.cancellation import shielded
from relay.errors import (
    ConfigError,
    EgressUnsupported,
    FileUnreadable,
    ImageNotFound,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
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
    Resources,
    SandboxRef,
    SandboxSpec,
)
from relay.providers.lifecycle import (
    DOMAIN,
    TIMEOUT_MARGIN_S,
    ErrorTable,
    ProviderSandbox,
    SandboxProvider,
)
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.e2b")

ALL_TRAFFIC = "0.0.0.0/0"
MAX_LIFETIME_S = 86_400  # E2B Pro; Hobby accounts stop at 3600 and E2B refuses more
KILL_COMMAND_TIMEOUT_S = 2.0
MAX_RECONNECTS = 3  # a command stream that breaks is followed again this many times
USER = "root"


def _by_status(exc: BaseException) -> type[ProviderError] | None:
    """An API answer the SDK raised without a class of its own, by its HTTP status."""
    status = getattr(exc, "status_code", None)
    if status in (401, 403):  # a key without the right to do this: as Modal and Vercel say
        return ProviderAuth
    if isinstance(status, int) and status >= 500:
        return ProviderUnavailable
    return None


ERRORS: ErrorTable = (
    (AuthenticationException, ProviderAuth),
    (RateLimitException, ProviderRateLimited),
    (SandboxNotRunningException, SandboxLost),
    ((SandboxUnreachableException, ServiceBusyException), ProviderUnavailable),
    ((TimeoutException, httpx.TimeoutException, TimeoutError), ProviderTimeout),
    ((httpx.TransportError, OSError), ProviderUnavailable),
    (NotFoundException, ProviderError),
    (Exception, _by_status),
)


class E2BSettings(ProviderSettings):
    """``RELAY_E2B_*``: the key, and URL overrides for a self-hosted E2B or a fake."""

    model_config = SettingsConfigDict(env_prefix="RELAY_E2B_")

    api_key: SecretStr | None = None
    api_url: str | None = None
    sandbox_url: str | None = None
    domain: str | None = None
    template: str = "base"


class E2BProvider(SandboxProvider["E2BSandbox"]):
    """Runs sandboxes on E2B; every SDK call gets the relay's credentials explicitly."""

    name: ClassVar[str] = "e2b"
    label: ClassVar[str] = "E2B"
    rate: ClassVar[Rate] = Rate(0.000014, 0.0000045)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = E2BSettings
    retry_after_s: ClassVar[float] = 5.0  # the SDK hides Retry-After (it already retried)
    extends_lifetime: ClassVar[bool] = True
    terminate_timeout_s: ClassVar[float] = 15.0

    def __init__(self, settings: Settings) -> None:
        config = settings.section(E2BSettings)
        if config.api_key is None:
            raise ConfigError("RELAY_E2B_API_KEY is required when the e2b provider is enabled")
        self._cluster = settings.cluster
        self._template = config.template
        self.create_timeout_s = settings.create_timeout_s
        domain = config.domain or "e2b.app"
        # Everything explicit, so no E2B_* variable of the relay's process steers the SDK.
        self._opts: dict[str, Any] = {
            "api_key": config.api_key.get_secret_value(),
            "domain": domain,
            "api_url": config.api_url or f"https://api.{domain}",
            "debug": False,
            # The SDK's own default, given so E2B_HTTP_VERSION can't change it. (Its pool
            # sizes and connection retries come from E2B_* variables read at import, with
            # no argument to pass instead: the relay sets none; the README says so.)
            "http_version": "2",
            "request_timeout": settings.create_timeout_s,
        }
        if config.sandbox_url:
            self._opts["sandbox_url"] = config.sandbox_url

    def check(self, spec: SandboxSpec) -> None:
        """Refuse what E2B cannot enforce; never widen a network policy."""
        hosts = spec.egress.hosts
        if not spec.egress.open:
            for host in hosts:
                if host == "*":
                    raise EgressUnsupported("'*' cannot be combined with other hosts")
                if not (_is_network(host) or DOMAIN.match(host)):
                    raise EgressUnsupported(
                        "E2B can only allow IP addresses, CIDR ranges and domain names"
                    )
        if spec.resources != Resources():
            raise SizeUnsupported(
                "E2B sandbox sizes are fixed by the template; build a template with "
                "this size and name it as the job's image instead"
            )
        if spec.lifetime_s > MAX_LIFETIME_S:
            raise ValidationFailed("E2B sandboxes live at most 24 hours")
        if spec.pip:
            raise ValidationFailed(
                "the e2b provider does not install pip packages; use a template that has them"
            )

    async def create(self, spec: SandboxSpec) -> E2BSandbox:
        network: dict[str, Any] | None = None
        internet: bool | None = None
        if spec.egress.none:
            internet = False
        elif spec.egress.open:
            internet = True
        else:
            network = {"allow_out": list(spec.egress.hosts), "deny_out": [ALL_TRAFFIC]}
        template = spec.image or self._template
        try:
            sdk = await AsyncSandbox.create(
                template=template,
                timeout=spec.lifetime_s,
                # Pinned, not left to the API's default: at the hard deadline the
                # sandbox is killed, never paused (a paused sandbox lives on).
                lifecycle={"on_timeout": "kill"},
                metadata=spec.tags,
                # The SDK retries a create answered 429/502/503/504; a key of this create
                # makes a retry return the sandbox a lost answer made, not a second one.
                idempotency_key=f"relay-{secrets.token_hex(16)}",
                allow_internet_access=internet,
                network=network,  # type: ignore[arg-type]
                **self._opts,
            )
        except Exception as exc:
            if getattr(exc, "status_code", None) == 404:
                raise ImageNotFound(f"E2B has no template named {template!r}") from exc
            raise
        return E2BSandbox(self, sdk)

    async def list_tagged(self) -> list[SandboxRef]:
        """Sandboxes (running or paused) whose metadata names this relay's cluster."""
        query = SandboxQuery(metadata={TAG_CLUSTER: self._cluster})
        pages = AsyncSandbox.list(query=query, **self._opts)
        refs: list[SandboxRef] = []
        while pages.has_next:
            for info in await pages.next_items():
                refs.append(
                    SandboxRef(
                        sandbox_id=info.sandbox_id,
                        run_id=(info.metadata or {}).get(TAG_RUN),
                        created_at=info.started_at,
                    )
                )
        return refs

    async def destroy(self, sandbox_id: str) -> None:
        """Kill a sandbox; one that is already gone (404) is success."""
        await AsyncSandbox.kill(sandbox_id, **self._opts)

    async def extend_lifetime(self, sandbox_id: str, lifetime_s: int) -> None:
        """A warm pool's sandbox, claimed: its timeout becomes the run's lifetime from now
        (E2B's ``set_timeout`` replaces the deadline, so it can also shorten it)."""
        await AsyncSandbox.set_timeout(sandbox_id, lifetime_s, **self._opts)

    async def aclose(self) -> None:
        """Nothing to release: the SDK's connection pools are process-wide and idle out."""


class E2BSandbox(ProviderSandbox):
    """A live E2B sandbox, valid inside :meth:`E2BProvider.sandbox`.

    Its files are read through envd's file API (e2b 2.63): ``files.list(path, depth=1)``
    (the ``ListDir`` RPC: a link is ``SYMLINK``, a special file is left out by the SDK)
    and ``files.read(path, format="stream")`` (``GET /files``, streamed, closed once the
    cap is read)."""

    def __init__(self, provider: E2BProvider, sdk: AsyncSandbox) -> None:
        super().__init__(provider, sdk.sandbox_id)
        self._sdk = sdk
        self._dirs: set[str] = set()

    async def folder_entries(self, path: str) -> list[FileEntry]:
        try:
            listed = await self._sdk.files.list(path, depth=1, user=USER)
        except FileNotFoundException as exc:
            raise FileUnreadable("no such folder") from exc
        kinds: dict[FileType | None, FileKind] = {
            FileType.FILE: "file", FileType.DIR: "folder", FileType.SYMLINK: "link"
        }  # fmt: skip
        return [
            FileEntry(entry.name, kinds.get(entry.type, "other"), entry.size) for entry in listed
        ]

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        try:
            reader = await self._sdk.files.read(path, format="stream", user=USER)
        except FileNotFoundException as exc:
            raise FileUnreadable("no such file") from exc
        read = 0
        try:
            async for chunk in reader:
                yield chunk
                read += len(chunk)
                if read >= limit:
                    break
        finally:
            await reader.aclose()

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        entries: list[Any] = [
            {"path": _absolute(path), "data": data} for path, data in files.items()
        ]
        if not entries:
            return
        await self._sdk.files.write_files(entries, user=USER)
        # envd creates parent directories as it writes: no make_dir needed for them.
        for entry in entries:
            parent = posixpath.dirname(entry["path"])
            while parent not in ("/", ""):
                self._dirs.add(parent)
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
        workdir = _absolute(workdir or DEFAULT_WORKDIR)
        source = "/dev/null"
        if workdir not in self._dirs:
            await self._sdk.files.make_dir(workdir, user=USER)
            self._dirs.add(workdir)
        if stdin is not None:
            source = f"/tmp/relay-stdin-{secrets.token_hex(8)}"  # noqa: S108 (in the VM)
            await self._sdk.files.write_files([{"path": source, "data": stdin}], user=USER)
        # The SDK only takes a shell line (bash -l -c): quote every argument; `exec`
        # makes the job the process envd tracks, so SendSignal reaches it.
        command = f"exec {shlex.join(argv)} < {shlex.quote(source)}"
        follow: dict[str, Any] = {
            "on_stdout": lambda text: output.write("stdout", text.encode()),
            "on_stderr": lambda text: output.write("stderr", text.encode()),
            "retain_output": False,
        }
        deadline = anyio.current_time() + timeout_s + TIMEOUT_MARGIN_S
        handle = None
        try:
            handle = await self._sdk.commands.run(
                command,
                background=True,
                envs=dict(env),
                user=USER,
                cwd=workdir,
                timeout=timeout_s + TIMEOUT_MARGIN_S,
                **follow,
            )
            for reconnects in range(MAX_RECONNECTS + 1):
                try:
                    result = await handle.wait()
                    return ExecResult(result.exit_code)
                except CommandExitException as exc:
                    return ExecResult(exc.exit_code)
                except Exception as exc:
                    if reconnects == MAX_RECONNECTS or not _stream_broke(exc):
                        raise
                handle = await self._reconnect(handle, deadline, follow)
            raise AssertionError("unreachable")
        except Exception as exc:
            await shielded(self._stop(handle))
            await self._raise_for(exc)
        except BaseException:
            # Cancelled (the relay's deadline): the SDK leaves the process running.
            await shielded(self._stop(handle))
            raise

    async def _reconnect(self, handle: Any, deadline: float, follow: dict[str, Any]) -> Any:
        """Follow the command again after its stream broke (output in the gap is lost)."""
        log.info("e2b: command stream of sandbox %s broke; reconnecting", self.id)
        with suppress(Exception):
            await handle.disconnect()
        remaining = max(1.0, deadline - anyio.current_time())
        try:
            return await self._sdk.commands.connect(handle.pid, timeout=remaining, **follow)
        except NotFoundException as exc:
            raise ProviderUnavailable(
                "E2B's command stream broke and the command's exit status was lost"
            ) from exc

    async def _stop(self, handle: Any) -> None:
        """SIGKILL the command and drop its stream, quickly (callers shield this)."""
        if handle is None:
            return
        with anyio.move_on_after(KILL_COMMAND_TIMEOUT_S), suppress(Exception):
            await handle.kill()
        with anyio.move_on_after(KILL_COMMAND_TIMEOUT_S), suppress(Exception):
            await handle.disconnect()

    async def _raise_for(self, exc: Exception) -> NoReturn:
        if isinstance(exc, ProviderError | SandboxException | AuthenticationException | OSError):
            raise exc  # mapped by the base
        # "Command ended without an end event": the stream broke. Tell a dead
        # sandbox (lost) from a broken connection (unavailable).
        running: bool | None = None
        with anyio.move_on_after(KILL_COMMAND_TIMEOUT_S), suppress(Exception):
            running = await self._sdk.is_running()
        if running is False:
            raise SandboxLost("the E2B sandbox disappeared during the run") from exc
        raise ProviderUnavailable("E2B's command stream ended before the command did") from exc


def _stream_broke(exc: Exception) -> bool:
    """A command stream that broke while the sandbox may well be alive: follow it again.

    The SDK reports a stream that ended without an end event as a bare ``Exception``, and
    a dropped connection as connectrpc's ``ConnectError`` or, when its health probe can't
    tell, ``SandboxUnreachableException``. A sandbox known to be gone is
    ``SandboxNotRunningException``: not worth a reconnect.
    """
    if isinstance(exc, SandboxUnreachableException):
        return True
    return not isinstance(exc, SandboxException | AuthenticationException)


def _is_network(host: str) -> bool:
    try:
        ipaddress.ip_network(host, strict=False)
    except ValueError:
        return False
    return True


def _absolute(path: str) -> str:
    return posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, path))
