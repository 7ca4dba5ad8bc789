"""Vercel Sandbox provider, through the ``vercel-sandbox`` SDK (``vercel.sandbox``, 0.10.0).

Each run gets one named sandbox (``<cluster>-<run id>-<random>``), created with the
spec's lifetime as Vercel's execution time limit, the relay's tags, its network policy
and size; ``persistent=False`` so stopping it takes no snapshot. Leaving the context
stops the session and destroys the sandbox. Credentials go to the SDK only through its
``credentials_factory`` (never the process environment, where ``VERCEL_OIDC_TOKEN``
would silently win), and the base URL comes from settings so a fake can stand in.

Work runs on the sandbox's *session* handle, not the sandbox handle: the sandbox handle
would transparently resume a stopped sandbox (a fresh session, billed again) and replay
the call, where the relay wants a stopped sandbox to end the run as ``sandbox_lost``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import re
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import ClassVar, TextIO, cast

import anyio
import httpx2
from vercel.sandbox import (
    NetworkPolicy,
    NetworkPolicyRule,
    NetworkPolicySubnets,
    Sandbox,
    SandboxApiError,
    SandboxClient,
    SandboxCredentials,
    SandboxCredentialsError,
    SandboxError,
    SandboxFilesystemWriteError,
    SandboxQueryByCreatedAt,
    SandboxResources,
    SandboxRuntimeSession,
    SandboxServiceOptions,
    SandboxStreamError,
    SandboxTerminalStateError,
    TagFilter,
)

from relay.errors import (
    ConfigError,
    EgressUnsupported,
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
)
from relay.settings import Settings

log = logging.getLogger("relay.providers.vercel")

VCPU_SIZES = (2, 4, 6, 8)
"""vCPU counts the API accepts (it refuses 1 and odd counts; 8 is the maximum)."""
MEMORY_PER_VCPU_MB = 2048
"""Vercel gives each vCPU 2 GB; memory is not set on its own."""
TERMINATE_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_MARGIN_S = 1.0
"""Vercel's own command timeout fires this much after the relay's deadline, so the relay's
cancellation (``timed_out``) wins and Vercel's SIGKILL is only the second line of defence."""
USER_WRITABLE = (PurePosixPath("/vercel/sandbox"), PurePosixPath("/tmp"))  # noqa: S108
_HOST = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
_LIFECYCLE_CODES = frozenset({"sandbox_stopped", "sandbox_stopping"})


def vcpus_for(cpu: float, memory_mb: int) -> int:
    """The smallest Vercel size with at least ``cpu`` vCPUs and ``memory_mb`` of memory."""
    for vcpus in VCPU_SIZES:
        if vcpus >= cpu and vcpus * MEMORY_PER_VCPU_MB >= memory_mb:
            return vcpus
    raise SizeUnsupported(
        f"vercel sandboxes have at most {VCPU_SIZES[-1]} vCPUs and "
        f"{VCPU_SIZES[-1] * MEMORY_PER_VCPU_MB} MB of memory"
    )


def network_policy_for(hosts: tuple[str, ...]) -> NetworkPolicy:
    """``()`` → deny all, ``("*",)`` → allow all, else domains and IP ranges allowed."""
    if not hosts:
        return NetworkPolicy.deny_all()
    if hosts == ("*",):
        return NetworkPolicy.allow_all()
    domains: dict[str, list[NetworkPolicyRule]] = {}
    networks: list[str] = []
    for host in hosts:
        try:
            networks.append(str(ipaddress.ip_network(host, strict=False)))
            continue
        except ValueError:
            pass
        if not _HOST.match(host.lower()):
            raise EgressUnsupported(
                f"vercel can allow host names (or *.domain) and IP ranges, not {host!r}"
            )
        domains[host.lower()] = []
    subnets = NetworkPolicySubnets(allow=networks) if networks else None
    return NetworkPolicy.custom(allow=domains, subnets=subnets)


def sandbox_name(spec: SandboxSpec) -> str:
    """A unique, findable name: the relay can destroy it even if the create answer is lost."""
    run = re.sub(r"[^a-z0-9]+", "-", spec.run_id.lower()).strip("-")[:32]
    return f"{spec.cluster}-{run}-{secrets.token_hex(3)}"


def _retry_after(exc: SandboxApiError) -> float | None:
    """Vercel's Retry-After in seconds; None unless it is a plain, finite number (the
    relay passes it on to the caller and keeps it with the run)."""
    try:
        seconds = float(exc.response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def provider_error(exc: BaseException, doing: str) -> ProviderError:
    """One mapping from SDK exceptions to the relay's; messages are ours, never Vercel's."""
    if isinstance(exc, SandboxFilesystemWriteError) and isinstance(exc.cause, SandboxApiError):
        exc = exc.cause
    if isinstance(exc, SandboxApiError):
        status = exc.status_code
        if status in (401, 403):
            return ProviderAuth(f"vercel refused the relay's credentials while {doing}")
        if status == 429:
            message = f"vercel is rate limiting the relay ({doing})"
            return ProviderRateLimited(message, retry_after=_retry_after(exc))
        if status in (404, 410) or exc.code in _LIFECYCLE_CODES:
            return SandboxLost(f"the vercel sandbox was gone while {doing}")
        if status >= 500:
            return ProviderUnavailable(f"vercel answered HTTP {status} while {doing}")
        return ProviderError(f"vercel rejected the request (HTTP {status}) while {doing}")
    if isinstance(exc, SandboxStreamError) and exc.code in _LIFECYCLE_CODES:
        return SandboxLost(f"the vercel sandbox stopped while {doing}")
    if isinstance(exc, SandboxCredentialsError):
        return ProviderAuth(f"the vercel credentials are unusable ({doing})")
    if isinstance(exc, SandboxTerminalStateError):
        return ProviderUnavailable(f"the vercel sandbox failed to start ({doing})")
    if isinstance(exc, httpx2.TimeoutException):
        return ProviderTimeout(f"vercel did not answer in time while {doing}")
    if isinstance(exc, httpx2.TransportError | SandboxError):
        return ProviderUnavailable(f"vercel could not be reached or answered badly ({doing})")
    return ProviderError(f"the vercel SDK failed while {doing} ({type(exc).__name__})")


class _SinkStream:
    """A text stream the SDK writes NDJSON output into as it arrives: straight to the sink."""

    def __init__(self, output: OutputSink, stream: StreamName) -> None:
        self._output, self._stream = output, stream

    def write(self, text: str) -> int:
        self._output.write(self._stream, text.encode("utf-8", errors="replace"))
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered here."""

    def writable(self) -> bool:
        return True


class VercelSandbox:
    """One Vercel sandbox, used through its current session."""

    def __init__(self, box: Sandbox, session: SandboxRuntimeSession) -> None:
        self.id: str = box.name
        self._session = session
        self._directories: set[str] = set()

    async def _ensure_directory(self, directory: str) -> None:
        """Create a working directory once; outside the user's own folders it needs root."""
        if directory in self._directories:
            return
        path = PurePosixPath(directory)
        if any(path == root or path.is_relative_to(root) for root in USER_WRITABLE):
            await self._session.fs.mkdir(directory, recursive=True)
        else:
            # Sandbox code runs as the unprivileged vercel-sandbox user; only root can
            # create /workspace. Mode 0777 lets that user write in it. Images without sudo
            # get a second, unprivileged try (enough where the parent is writable).
            for sudo in (True, False):
                made = await self._session.run_process(
                    "mkdir", ["-p", "-m", "0777", "--", directory], sudo=sudo, capture_output=True
                )
                if made.returncode == 0:
                    break
            else:
                raise ProviderError(
                    f"could not create the working directory {directory}; "
                    "a job workdir under /vercel/sandbox always works"
                )
        self._directories.add(directory)

    async def upload(self, files: Mapping[str, bytes]) -> None:
        if not files:
            return
        try:
            if any(not path.startswith("/") for path in files):
                await self._ensure_directory(DEFAULT_WORKDIR)
            async with self._session.fs.batch(cwd=DEFAULT_WORKDIR) as batch:
                for path, content in files.items():
                    batch.write_bytes(path, content)
        except (SandboxError, httpx2.TransportError) as exc:
            raise provider_error(exc, "uploading files") from exc

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
        if not argv:
            raise ProviderError("there is no command to run")
        directory = str(PurePosixPath(DEFAULT_WORKDIR, workdir or "."))
        try:
            await self._ensure_directory(directory)
            # argv goes over the wire as a list (command + args); nothing is parsed by a
            # shell on either side. Output streams into the sink record by record.
            done = await self._session.run_process(
                argv[0],
                list(argv[1:]),
                cwd=directory,
                env=dict(env),
                kill_after=timeout_s + COMMAND_TIMEOUT_MARGIN_S,
                stdout=cast(TextIO, _SinkStream(output, "stdout")),
                stderr=cast(TextIO, _SinkStream(output, "stderr")),
                input=stdin,
            )
        except (SandboxError, httpx2.TransportError) as exc:
            raise provider_error(exc, "running the command") from exc
        return ExecResult(exit_code=done.returncode)


class VercelProvider:
    """Runs each job in a fresh Vercel Sandbox; see the module docstring."""

    name: ClassVar[str] = "vercel"

    def __init__(self, settings: Settings) -> None:
        token, team, project = (
            settings.vercel_token,
            settings.vercel_team_id,
            settings.vercel_project_id,
        )
        if token is None or not team or not project:
            raise ConfigError(
                "the vercel provider needs RELAY_VERCEL_TOKEN, RELAY_VERCEL_TEAM_ID "
                "and RELAY_VERCEL_PROJECT_ID"
            )
        # Kept as a SecretStr; the SDK's credentials object (whose repr shows the token)
        # is built only when the SDK asks for it.
        self._token, self._team, self._project = token, team, project
        options = SandboxServiceOptions(
            base_url=settings.vercel_base_url or None, credentials_factory=self._credentials_of
        )
        # Each running command holds one connection for its output stream; the SDK's
        # default pool (100) would leave stop/destroy calls queueing behind them at high
        # concurrency, so size the pool from the relay's own limit.
        connections = max(100, 4 * settings.max_concurrent)

        def http_client() -> httpx2.AsyncClient:
            limits = httpx2.Limits(max_connections=connections)
            return httpx2.AsyncClient(timeout=httpx2.Timeout(60.0), limits=limits)

        self._client = SandboxClient.create(options=options, httpx_client_factory=http_client)
        self._cluster = settings.cluster
        self._create_timeout_s = settings.create_timeout_s

    async def _credentials_of(self) -> SandboxCredentials:
        return SandboxCredentials(self._token.get_secret_value(), self._team, self._project)

    def check(self, spec: SandboxSpec) -> None:
        if "*" in spec.egress.hosts and not spec.egress.open:
            raise EgressUnsupported('"*" allows everything; give it alone or not at all')
        network_policy_for(spec.egress.hosts)
        vcpus_for(spec.resources.cpu, spec.resources.memory_mb)
        if spec.pip:
            raise ValidationFailed(
                "the vercel provider does not install pip packages; use an image that has them"
            )

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[VercelSandbox]:
        self.check(spec)
        box = await self._create(spec, sandbox_name(spec))
        session = box.current_session
        try:
            if session is None:
                raise ProviderUnavailable("vercel created a sandbox without a session")
            yield VercelSandbox(box, session)
        except BaseException:
            # Already logged if it fails; the run's own error is the one to report.
            with anyio.CancelScope(shield=True), contextlib.suppress(ProviderError):
                await self._end(box)
            raise
        with anyio.CancelScope(shield=True):
            await self._end(box)

    async def _create(self, spec: SandboxSpec, name: str) -> Sandbox:
        try:
            with anyio.fail_after(self._create_timeout_s):
                return await self._client.create_sandbox(
                    name=name,
                    image=spec.image,
                    execution_time_limit=spec.lifetime_s,
                    resources=SandboxResources(
                        vcpus=vcpus_for(spec.resources.cpu, spec.resources.memory_mb)
                    ),
                    persistent=False,
                    network_policy=network_policy_for(spec.egress.hosts),
                    env=dict(spec.env),
                    tags=spec.tags,
                )
        except BaseException as exc:
            # The sandbox may exist even though the answer failed or never came: it has a
            # known name, so destroy it now (the reaper would find it by its tags later).
            maybe_allocated = not (
                isinstance(exc, SandboxApiError) and 400 <= exc.status_code < 500
            )
            if maybe_allocated:
                # Logged if it fails; the create failure is what the caller needs.
                with anyio.CancelScope(shield=True), contextlib.suppress(ProviderError):
                    await self.terminate(name)
            if isinstance(exc, TimeoutError):
                raise ProviderTimeout("vercel did not create the sandbox in time") from exc
            if isinstance(exc, Exception):
                raise provider_error(exc, "creating the sandbox") from exc
            raise

    async def _end(self, box: Sandbox) -> None:
        """Stop the session and destroy the sandbox, bounded in time; raise if it may live on."""
        try:
            with anyio.fail_after(TERMINATE_TIMEOUT_S):
                stop_error: BaseException | None = None
                try:
                    await box.stop()
                except (SandboxError, httpx2.TransportError) as exc:
                    stop_error = exc  # destroying the sandbox may still end it
                try:
                    await box.destroy(delete_orphan_snapshots=True)
                except SandboxApiError as exc:
                    if exc.status_code != 404:
                        raise  # a failed stop followed by a failed destroy lands here too
                if stop_error is not None:
                    name, error = box.name, type(stop_error).__name__
                    log.info("vercel sandbox %s: stop failed (%s), destroy ended it", name, error)
        except (SandboxError, httpx2.TransportError, TimeoutError) as exc:
            raise self._terminate_failed(box.name, exc) from exc

    def _terminate_failed(self, sandbox_id: str, exc: BaseException) -> ProviderError:
        """Log a failed terminate (id and exception class only) and say what to raise."""
        log.error(
            "vercel sandbox %s could not be terminated (%s); the reaper will retry",
            sandbox_id,
            type(exc).__name__,
            extra={"provider": self.name, "sandbox_id": sandbox_id},
        )
        if isinstance(exc, TimeoutError):
            return ProviderTimeout("vercel did not terminate the sandbox in time")
        return provider_error(exc, "terminating the sandbox")

    async def list_owned(self) -> list[SandboxRef]:
        query = SandboxQueryByCreatedAt(tag=TagFilter(key=TAG_CLUSTER, value=self._cluster))
        owned: list[SandboxRef] = []
        try:
            async for box in self._client.query_sandboxes(query=query):
                tags = box.tags or {}
                if tags.get(TAG_CLUSTER) != self._cluster:
                    continue  # the filter is the server's; check it here too
                created = box.created_at
                when = None if created is None else datetime.fromtimestamp(created / 1000, UTC)
                owned.append(SandboxRef(box.name, tags.get(TAG_RUN), created_at=when))
        except (SandboxError, httpx2.TransportError) as exc:
            raise provider_error(exc, "listing sandboxes") from exc
        return owned

    async def terminate(self, sandbox_id: str) -> None:
        try:
            with anyio.fail_after(TERMINATE_TIMEOUT_S):
                box = await self._client.get_sandbox(name=sandbox_id)
        except SandboxApiError as exc:
            if exc.status_code in (404, 410):
                return  # already gone: terminate is idempotent
            raise self._terminate_failed(sandbox_id, exc) from exc
        except (SandboxError, httpx2.TransportError, TimeoutError) as exc:
            raise self._terminate_failed(sandbox_id, exc) from exc
        await self._end(box)

    async def aclose(self) -> None:
        await self._client.aclose()
