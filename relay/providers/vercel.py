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

import ipaddress
import logging
import math
import re
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import ClassVar, TextIO, cast

import httpx2
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict
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
    SandboxFilesystemCommandError,
    SandboxFilesystemWriteError,
    SandboxPathNotFoundError,
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
    FileUnreadable,
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
    SandboxRef,
    SandboxSpec,
    StreamName,
)
from relay.providers.lifecycle import (
    DOMAIN,
    TIMEOUT_MARGIN_S,
    ErrorTable,
    ProviderSandbox,
    SandboxProvider,
)
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.vercel")

VCPU_SIZES = (2, 4, 6, 8)
"""vCPU counts the API accepts (it refuses 1 and odd counts; 8 is the maximum)."""
MEMORY_PER_VCPU_MB = 2048
"""Vercel gives each vCPU 2 GB; memory is not set on its own."""
USER_WRITABLE = (PurePosixPath("/vercel/sandbox"), PurePosixPath("/tmp"))  # noqa: S108
READ_BYTES = 65_536
"""Bytes asked of a file read at a time."""
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
        if not DOMAIN.match(host.lower()):
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


def _classify(exc: BaseException) -> ProviderError | type[ProviderError] | None:
    """An API answer, by its status and lifecycle code (a write error carries its cause)."""
    if isinstance(exc, SandboxFilesystemWriteError) and isinstance(exc.cause, SandboxApiError):
        exc = exc.cause
    if isinstance(exc, SandboxApiError):
        status = exc.status_code
        if status in (401, 403):
            return ProviderAuth
        if status == 429:
            retry_after = _retry_after(exc)
            return ProviderRateLimited("vercel is rate limiting the relay", retry_after=retry_after)
        if status in (404, 410) or exc.code in _LIFECYCLE_CODES:
            return SandboxLost
        if status >= 500:
            return ProviderUnavailable
        return ProviderError
    if isinstance(exc, SandboxStreamError) and exc.code in _LIFECYCLE_CODES:
        return SandboxLost
    return None


ERRORS: ErrorTable = (
    ((SandboxApiError, SandboxFilesystemWriteError, SandboxStreamError), _classify),
    (SandboxCredentialsError, ProviderAuth),
    (SandboxTerminalStateError, ProviderUnavailable),
    (httpx2.TimeoutException, ProviderTimeout),
    ((httpx2.TransportError, SandboxError), ProviderUnavailable),
)
_ENDED = frozenset({"stopped", "stopping", "failed", "aborted"})


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


class VercelSandbox(ProviderSandbox):
    """One Vercel sandbox, used through its current session.

    Its files are read through the SDK's file API (vercel-sandbox 0.10.0):
    ``fs.listdir`` (a ``find -H … -printf '%f\\0%y\\0'`` the SDK runs in the sandbox: a
    link is ``symlink``, never followed) and ``fs.open(path, "rb")`` (``POST …/fs/read``,
    streamed, closed once the cap is read)."""

    def __init__(
        self, provider: VercelProvider, box: Sandbox, session: SandboxRuntimeSession
    ) -> None:
        super().__init__(provider, box.name)
        self._session = session
        self._directories: set[str] = set()

    async def folder_entries(self, path: str) -> list[FileEntry]:
        try:
            listed = await self._session.fs.listdir(path)
        except (SandboxFilesystemCommandError, SandboxPathNotFoundError) as exc:
            raise FileUnreadable("no such folder") from exc
        kinds: dict[str, FileKind] = {"file": "file", "directory": "folder", "symlink": "link"}
        return [FileEntry(entry.path, kinds.get(entry.kind, "other")) for entry in listed]

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        try:
            async with self._session.fs.open(path, "rb") as reader:
                read = 0
                while read < limit and (chunk := await reader.read(READ_BYTES)):
                    read += len(chunk)
                    yield chunk
        except SandboxPathNotFoundError as exc:
            raise FileUnreadable("no such file") from exc

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

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        if not files:
            return
        if any(not path.startswith("/") for path in files):
            await self._ensure_directory(DEFAULT_WORKDIR)
        async with self._session.fs.batch(cwd=DEFAULT_WORKDIR) as batch:
            for path, content in files.items():
                batch.write_bytes(path, content)

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
        if not argv:
            raise ProviderError("there is no command to run")
        directory = str(PurePosixPath(DEFAULT_WORKDIR, workdir or "."))
        await self._ensure_directory(directory)
        # argv goes over the wire as a list (command + args); nothing is parsed by a
        # shell on either side. Output streams into the sink record by record.
        done = await self._session.run_process(
            argv[0],
            list(argv[1:]),
            cwd=directory,
            env=dict(env),
            kill_after=timeout_s + TIMEOUT_MARGIN_S,
            stdout=cast(TextIO, _SinkStream(output, "stdout")),
            stderr=cast(TextIO, _SinkStream(output, "stderr")),
            input=stdin,
        )
        return ExecResult(exit_code=done.returncode)


class VercelSettings(ProviderSettings):
    """``RELAY_VERCEL_*``: the access token, the team and project sandboxes are billed to."""

    model_config = SettingsConfigDict(env_prefix="RELAY_VERCEL_")

    token: SecretStr | None = None
    team_id: str | None = None
    project_id: str | None = None
    base_url: str | None = None


class VercelProvider(SandboxProvider[VercelSandbox]):
    """Runs each job in a fresh Vercel Sandbox; see the module docstring."""

    name: ClassVar[str] = "vercel"
    label: ClassVar[str] = "vercel"
    # Vercel bills active CPU ($0.128 per vCPU-hour) and provisioned memory ($0.0106 per
    # GB-hour); charging every second as active CPU gives an upper bound.
    rate: ClassVar[Rate] = Rate(0.128 / 3600, 0.0106 / 3600)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = VercelSettings
    terminate_timeout_s: ClassVar[float] = 30.0

    def __init__(self, settings: Settings) -> None:
        config = settings.section(VercelSettings)
        token, team, project = config.token, config.team_id, config.project_id
        if token is None or not team or not project:
            raise ConfigError(
                "the vercel provider needs RELAY_VERCEL_TOKEN, RELAY_VERCEL_TEAM_ID "
                "and RELAY_VERCEL_PROJECT_ID"
            )
        # Kept as a SecretStr; the SDK's credentials object (whose repr shows the token)
        # is built only when the SDK asks for it.
        self._token, self._team, self._project = token, team, project
        options = SandboxServiceOptions(
            base_url=config.base_url or None, credentials_factory=self._credentials_of
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
        self.create_timeout_s = settings.create_timeout_s
        self._boxes: dict[str, Sandbox] = {}
        """Each sandbox this relay created and has not terminated yet."""

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

    async def create(self, spec: SandboxSpec) -> VercelSandbox:
        # A unique, known name: the sweep after a failed create finds it by its tags.
        box = await self._client.create_sandbox(
            name=sandbox_name(spec),
            image=spec.image,
            execution_time_limit=spec.lifetime_s,
            resources=SandboxResources(
                vcpus=vcpus_for(spec.resources.cpu, spec.resources.memory_mb)
            ),
            persistent=False,
            network_policy=network_policy_for(spec.egress.hosts),
            tags=spec.tags,
        )
        self._boxes[box.name] = box
        session = box.current_session
        if session is None:
            raise ProviderUnavailable("vercel created a sandbox without a session")
        return VercelSandbox(self, box, session)

    async def destroy(self, sandbox_id: str) -> None:
        """Stop the session and destroy the sandbox; one already gone maps to success."""
        box = self._boxes.pop(sandbox_id, None)
        if box is None:
            box = await self._client.get_sandbox(name=sandbox_id)
        try:
            await box.stop()
        except (SandboxError, httpx2.TransportError) as exc:
            # Destroying the sandbox may still end it; if that fails too, it raises.
            log.info("vercel sandbox %s: stop failed (%s)", sandbox_id, type(exc).__name__)
        await box.destroy(delete_orphan_snapshots=True)

    async def gone(self, sandbox_id: str) -> bool:
        try:
            box = await self._client.get_sandbox(name=sandbox_id)
        except SandboxApiError as exc:
            return exc.status_code in (404, 410)
        except (SandboxError, httpx2.TransportError):
            return False
        return box.status in _ENDED

    async def list_tagged(self) -> list[SandboxRef]:
        query = SandboxQueryByCreatedAt(tag=TagFilter(key=TAG_CLUSTER, value=self._cluster))
        owned: list[SandboxRef] = []
        async for box in self._client.query_sandboxes(query=query):
            tags = box.tags or {}
            if tags.get(TAG_CLUSTER) != self._cluster:
                continue  # the filter is the server's; check it here too
            created = box.created_at
            when = None if created is None else datetime.fromtimestamp(created / 1000, UTC)
            owned.append(SandboxRef(box.name, tags.get(TAG_RUN), created_at=when))
        return owned

    async def aclose(self) -> None:
        await self._client.aclose()
