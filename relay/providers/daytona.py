"""Daytona provider: one sandbox per run, through the ``daytona`` SDK (0.226.1, ``AsyncDaytona``).

Mapping (see docs/providers/daytona.md):

* ``spec.lifetime_s`` -> ``ttl_minutes`` (Daytona destroys the sandbox that long after its
  creation, whatever its state, relay or not), rounded *up* to a whole minute; the sandbox
  is also ephemeral (``auto_delete_interval=0``: deleted as soon as it stops) and auto-stops
  after the same number of idle minutes, a second backstop where the organisation caps TTL;
* ``spec.tags`` -> ``labels`` (``list_tagged`` filters on the cluster label);
* egress ``()`` -> ``network_block_all``; IP ranges -> ``network_allow_list``; host names ->
  ``domain_allow_list``; ``("*",)`` -> the account's own network (never wider than asked:
  lower tiers restrict it further);
* no image and the default size -> the default snapshot (``RELAY_DAYTONA_SNAPSHOT``: 1 vCPU,
  1 GiB, 3 GiB disk); an image or a larger size -> a sandbox built from the image
  (``RELAY_DAYTONA_IMAGE`` by default) with whole vCPUs and GiB, up to the tier's maxima.

Commands run in a session of the Daytona daemon: the daemon only takes a shell line, so
every argument is quoted, stdin is uploaded and redirected from a file, and output comes
back live over the session's log WebSocket (stdout and stderr apart). A log stream that
ends before the command did is followed again, skipping what was already seen.

The job's env goes one way: with the command, in an uploaded file its line reads and
removes before the job starts; never at create (the sandbox has no env of the job's), never
on the session's command line (which the toolbox API shows to anyone with the key).

Credentials and URLs are handed to the SDK explicitly (key, API URL, target all set), so no
``DAYTONA_*`` variable or ``.env`` entry chooses where the key goes. The SDK's socket.io event
stream is turned off (state is polled instead): one host and one protocol fewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import posixpath
import re
import secrets
import shlex
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from typing import ClassVar

import aiohttp
import anyio
from daytona import (
    AsyncDaytona,
    AsyncSandbox,
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    DaytonaAuthenticationError,
    DaytonaConfig,
    DaytonaConnectionError,
    DaytonaError,
    DaytonaFileNotFoundError,
    DaytonaForbiddenError,
    DaytonaGoneError,
    DaytonaNotFoundError,
    DaytonaRateLimitError,
    DaytonaTimeoutError,
    FileUpload,
    ListSandboxesQuery,
    SessionExecuteRequest,
)
from daytona import Resources as DaytonaResources
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict

from relay.cancellation import shielded
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
    Resources,
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
    variables_file,
)
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.daytona")

DEFAULT_SIZE = (1, 1, 3)
"""vCPUs, GiB of memory and GiB of disk of a sandbox from Daytona's default snapshot."""
MAX_SIZE = (4, 8, 10)
"""The largest sandbox Daytona's default tier gives (vCPUs, GiB memory, GiB disk)."""
MAX_ALLOWED_NETWORKS = 5
"""Daytona's network allow-list takes at most this many CIDR ranges."""
MAX_RECONNECTS = 5
"""A log stream that ends before its command is followed again this many times."""
REFOLLOW_PAUSE_S = 0.1
"""The pause before following again, times the attempt (the status may lag the stream)."""
CLEANUP_TIMEOUT_S = 3.0
_GONE_STATES = frozenset(
    {"destroyed", "destroying", "stopped", "stopping", "error", "build_failed", "archived"}
)
"""States of a sandbox that can no longer run the command (it was killed)."""
_ENDING_STATES = frozenset({"destroyed", "destroying"})
"""States of a sandbox already deleted: Daytona still shows it a while (get, list) and
refuses another delete meanwhile; neither the reaper nor a terminate has anything to do."""


def _state(box: AsyncSandbox) -> str:
    """The state's wire value (the async client has its own enum class for it)."""
    return str(getattr(box.state, "value", box.state))


def _retry_after(exc: DaytonaRateLimitError) -> float:
    """Daytona's Retry-After (kept by the SDK in ``headers``), at least a second."""
    headers = {str(key).lower(): value for key, value in (exc.headers or {}).items()}
    try:
        seconds = float(headers.get("retry-after", ""))
    except (TypeError, ValueError):
        return DaytonaProvider.retry_after_s
    return max(1.0, seconds) if math.isfinite(seconds) else DaytonaProvider.retry_after_s


def _classify(exc: BaseException) -> ProviderError | type[ProviderError] | None:
    """A Daytona answer by its class, or by its status when the SDK has no class for it."""
    if isinstance(exc, DaytonaAuthenticationError | DaytonaForbiddenError):
        return ProviderAuth
    if isinstance(exc, DaytonaRateLimitError):
        return ProviderRateLimited(
            "daytona is rate limiting the relay", retry_after=_retry_after(exc)
        )
    if isinstance(exc, DaytonaNotFoundError | DaytonaGoneError):
        return SandboxLost
    if isinstance(exc, DaytonaConnectionError):
        return ProviderTimeout if isinstance(exc, DaytonaTimeoutError) else ProviderUnavailable
    if isinstance(exc, DaytonaTimeoutError):
        return ProviderTimeout
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status >= 500:
        return ProviderUnavailable
    return ProviderError


ERRORS: ErrorTable = (
    (DaytonaError, _classify),
    ((aiohttp.ServerTimeoutError, asyncio.TimeoutError), ProviderTimeout),
    ((aiohttp.ClientError, OSError), ProviderUnavailable),
)


def size_of(resources: Resources) -> tuple[int, int, int] | None:
    """Whole vCPUs and GiB for a size; None when the default sandbox already has it."""
    cpu = math.ceil(resources.cpu)
    memory = math.ceil(resources.memory_mb / 1024)
    disk = max(DEFAULT_SIZE[2], math.ceil(resources.disk_mb / 1024))
    if cpu <= DEFAULT_SIZE[0] and memory <= DEFAULT_SIZE[1] and disk <= DEFAULT_SIZE[2]:
        return None
    if cpu > MAX_SIZE[0] or memory > MAX_SIZE[1] or disk > MAX_SIZE[2]:
        raise SizeUnsupported(
            f"daytona sandboxes have at most {MAX_SIZE[0]} vCPUs, {MAX_SIZE[1]} GiB of memory "
            f"and {MAX_SIZE[2]} GiB of disk"
        )
    return (max(cpu, DEFAULT_SIZE[0]), max(memory, DEFAULT_SIZE[1]), disk)


def network_of(hosts: tuple[str, ...]) -> dict[str, object]:
    """The create fields for an egress policy; :class:`EgressUnsupported`, never wider."""
    if not hosts:
        return {"network_block_all": True}
    if hosts == ("*",):
        return {}
    networks: list[str] = []
    domains: list[str] = []
    for host in hosts:
        if host == "*":
            raise EgressUnsupported('"*" allows everything; give it alone or not at all')
        try:
            networks.append(str(ipaddress.ip_network(host, strict=False)))
            continue
        except ValueError:
            pass
        if host.startswith("*.") or not DOMAIN.match(host):
            raise EgressUnsupported(
                f"daytona can allow IP ranges and plain host names, not {host!r}"
            )
        domains.append(host.lower())
    if len(networks) > MAX_ALLOWED_NETWORKS:
        raise EgressUnsupported(f"daytona allows at most {MAX_ALLOWED_NETWORKS} IP ranges")
    fields: dict[str, object] = {}
    if networks:
        fields["network_allow_list"] = ",".join(networks)
    if domains:
        fields["domain_allow_list"] = ",".join(domains)
    return fields


def sandbox_name(spec: SandboxSpec) -> str:
    """A unique name with the run in it (Daytona names: letters, digits, hyphens)."""
    run = re.sub(r"[^a-z0-9]+", "-", spec.run_id.lower()).strip("-")[:32]
    cluster = re.sub(r"[^a-z0-9]+", "-", spec.cluster.lower()).strip("-")[:16]
    return f"{cluster}-{run}-{secrets.token_hex(3)}"


def _created_at(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


class DaytonaSettings(ProviderSettings):
    """``RELAY_DAYTONA_*``: the key, the API URL and region, what sandboxes start from."""

    model_config = SettingsConfigDict(env_prefix="RELAY_DAYTONA_")

    api_key: SecretStr | None = None
    api_url: str = "https://app.daytona.io/api"
    target: str = "us"
    snapshot: str | None = None
    image: str = "python:3.12-slim"


class DaytonaProvider(SandboxProvider["DaytonaSandbox"]):
    """Runs sandboxes on Daytona; see the module docstring."""

    name: ClassVar[str] = "daytona"
    label: ClassVar[str] = "daytona"
    # List prices: $0.0504 per vCPU-hour and $0.0162 per GiB-hour of memory.
    rate: ClassVar[Rate] = Rate(0.0504 / 3600, 0.0162 / 3600)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = DaytonaSettings
    retry_after_s: ClassVar[float] = 5.0
    terminate_timeout_s: ClassVar[float] = 15.0

    def __init__(self, settings: Settings) -> None:
        config = settings.section(DaytonaSettings)
        if config.api_key is None:
            raise ConfigError(
                "RELAY_DAYTONA_API_KEY is required when the daytona provider is enabled"
            )
        self._cluster = settings.cluster
        self._snapshot = config.snapshot
        self._image = config.image
        self.create_timeout_s = settings.create_timeout_s
        # Key, URL and target all given: the SDK then reads none of them from DAYTONA_* or a
        # .env file. Polling instead of socket.io keeps the SDK to the API and the toolbox;
        # its deprecation warning is about that mode, not about anything a caller did.
        sdk_config = DaytonaConfig(
            api_key=config.api_key.get_secret_value(),
            api_url=config.api_url.rstrip("/"),
            target=config.target,
            use_deprecated_polling=True,
            otel_enabled=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self._client = AsyncDaytona(sdk_config)
        self._boxes: dict[str, AsyncSandbox] = {}
        """Each sandbox this relay created and has not terminated yet."""

    def check(self, spec: SandboxSpec) -> None:
        network_of(spec.egress.hosts)
        size_of(spec.resources)
        if spec.pip:
            raise ValidationFailed(
                "the daytona provider does not install pip packages; use an image that has them"
            )

    async def create(self, spec: SandboxSpec) -> DaytonaSandbox:
        minutes = math.ceil(spec.lifetime_s / 60)
        common: dict[str, object] = {
            "name": sandbox_name(spec),
            "labels": spec.tags,
            "ttl_minutes": minutes,
            "auto_stop_interval": minutes,
            "ephemeral": True,
            "public": False,
            **network_of(spec.egress.hosts),
        }
        size = size_of(spec.resources)
        params: CreateSandboxFromImageParams | CreateSandboxFromSnapshotParams
        if spec.image is None and size is None:
            params = CreateSandboxFromSnapshotParams(snapshot=self._snapshot, **common)
        else:
            cpu, memory, disk = size or DEFAULT_SIZE
            params = CreateSandboxFromImageParams(
                image=spec.image or self._image,
                resources=DaytonaResources(cpu=cpu, memory=memory, disk=disk),
                **common,
            )
        box = await self._client.create(params, timeout=self.create_timeout_s)
        self._boxes[box.id] = box
        return DaytonaSandbox(self, box)

    async def destroy(self, sandbox_id: str) -> None:
        """Delete the sandbox; one already gone (404) or being deleted is success."""
        # Popped first: a delete that fails is retried by the reaper through a fresh get,
        # and a sandbox lost mid-run (404) leaves no entry behind.
        box = self._boxes.pop(sandbox_id, None)
        if box is None:
            box = await self._client.get(sandbox_id)
            if _state(box) in _ENDING_STATES:
                return
        await box.delete(timeout=self.terminate_timeout_s)

    async def gone(self, sandbox_id: str) -> bool:
        try:
            box = await self._client.get(sandbox_id)
        except DaytonaNotFoundError:
            return True
        except (DaytonaError, aiohttp.ClientError, OSError):
            return False
        return _state(box) in _GONE_STATES

    async def list_tagged(self) -> list[SandboxRef]:
        owned: list[SandboxRef] = []
        query = ListSandboxesQuery(labels={TAG_CLUSTER: self._cluster}, limit=100)
        async for box in self._client.list(query):
            labels = box.labels or {}
            if labels.get(TAG_CLUSTER) != self._cluster or _state(box) in _ENDING_STATES:
                continue  # the filter is the server's; check it here too
            owned.append(SandboxRef(box.id, labels.get(TAG_RUN), _created_at(box.created_at)))
        return owned

    async def aclose(self) -> None:
        await self._client.close()  # type: ignore[no-untyped-call]


class DaytonaSandbox(ProviderSandbox):
    """A live Daytona sandbox, valid inside :meth:`DaytonaProvider.sandbox`.

    Its files are read through the toolbox (daytona 0.226.1): ``fs.list_files`` (the
    daemon lists with lstat: a link's ``mode`` starts with ``L``, a FIFO's with ``p``)
    and ``fs.download_file_stream`` (a streamed bulk download, left once the cap is read).
    """

    def __init__(self, provider: DaytonaProvider, box: AsyncSandbox) -> None:
        super().__init__(provider, box.id)
        self._box = box

    async def folder_entries(self, path: str) -> list[FileEntry]:
        try:
            listed = await self._box.fs.list_files(path)
        except DaytonaFileNotFoundError as exc:
            raise FileUnreadable("no such folder") from exc
        return [FileEntry(info.name, _kind(info.mode), info.size) for info in listed]

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        if size == 0:
            return  # the SDK's stream raises for a file that sends no bytes
        try:
            stream = await self._box.fs.download_file_stream(path)
            read = 0
            try:
                async for chunk in stream:
                    yield chunk
                    read += len(chunk)
                    if read >= limit:
                        break
            finally:
                if isinstance(stream, AsyncGenerator):  # its HTTP answer closed now, not at GC
                    await stream.aclose()
        except DaytonaFileNotFoundError as exc:
            raise FileUnreadable("no such file") from exc

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        if not files:
            return
        uploads = [
            FileUpload(source=data, destination=_absolute(path)) for path, data in files.items()
        ]
        await self._box.fs.upload_files(uploads)

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
        source = "/dev/null"
        uploads: list[FileUpload] = []
        if stdin is not None:
            source = f"/tmp/relay-stdin-{secrets.token_hex(8)}"  # noqa: S108 (in the sandbox)
            uploads.append(FileUpload(source=stdin, destination=source))
        # The whole env travels in a file: a command line is shown by the toolbox API.
        variables = None
        if env:
            variables = f"/tmp/relay-env-{secrets.token_hex(8)}"  # noqa: S108 (in the sandbox)
            uploads.append(FileUpload(source=variables_file(env), destination=variables))
        if uploads:
            await self._box.fs.upload_files(uploads)
        directory = _absolute(workdir or DEFAULT_WORKDIR)
        command = command_line(argv, directory, source, timeout_s, variables=variables)
        session = f"relay-{secrets.token_hex(8)}"
        process = self._box.process
        await process.create_session(session)
        try:
            started = await process.execute_session_command(
                session, SessionExecuteRequest(command=command, run_async=True)
            )
            return await self._follow(session, str(started.cmd_id), output)
        except (DaytonaError, aiohttp.ClientError, OSError) as exc:
            if await self.provider.gone(self.id):
                raise SandboxLost("the daytona sandbox was gone during the run") from exc
            raise
        finally:
            # Ends the command too, if it still runs (cancelled: the relay's deadline).
            await shielded(self._end_session(session))

    async def _follow(self, session: str, command_id: str, output: OutputSink) -> ExecResult:
        """Stream the command's output into the sink until it exits; a stream that ends
        early is followed again (it replays from the start: what was seen is skipped)."""
        replay = _Replay(output)
        process = self._box.process
        for attempt in range(MAX_RECONNECTS + 1):
            replay.restart()
            await process.get_session_command_logs_async(
                session, command_id, replay.writer("stdout"), replay.writer("stderr")
            )
            command = await process.get_session_command(session, command_id)
            if command.exit_code is not None:
                return ExecResult(int(command.exit_code))
            # Ended before the command did (a cut stream, or the daemon not done writing
            # the status): follow again; the replay brings whatever came after the cut.
            log.info("daytona: log stream of sandbox %s ended early; following again", self.id)
            await asyncio.sleep(REFOLLOW_PAUSE_S * (attempt + 1))
        raise ProviderUnavailable("daytona's log stream kept ending before the command did")

    async def _end_session(self, session: str) -> None:
        with anyio.move_on_after(CLEANUP_TIMEOUT_S), contextlib.suppress(Exception):
            await self._box.process.delete_session(session)


class _Replay:
    """Writes a log stream into the sink; a stream followed again replays from the start,
    so what an earlier follow already wrote is skipped, per stream, byte for byte."""

    def __init__(self, output: OutputSink) -> None:
        self._output = output
        self._seen: dict[StreamName, int] = {"stdout": 0, "stderr": 0}
        self._skip: dict[StreamName, int] = {"stdout": 0, "stderr": 0}

    def restart(self) -> None:
        self._skip = dict(self._seen)

    def writer(self, stream: StreamName) -> Callable[[str], None]:
        def write(text: str) -> None:
            data = text.encode("utf-8", errors="replace")
            skip = min(len(data), self._skip[stream])
            self._skip[stream] -= skip
            self._seen[stream] += len(data) - skip
            self._output.write(stream, data[skip:])

        return write


def command_line(
    argv: Sequence[str],
    directory: str,
    source: str,
    timeout_s: float,
    *,
    variables: str | None = None,
) -> str:
    """The shell line for a session: argv quoted word by word, never parsed by a shell.

    A subshell, so ``exec`` replaces it and not the session's own shell; ``timeout`` is the
    second line of defence behind the relay's deadline (sessions have no timeout field).
    No variable's value is on the line: ``variables`` names an uploaded file of them
    (:func:`variables_file`), read into the environment and removed before the job starts.
    """
    seconds = math.ceil(timeout_s + TIMEOUT_MARGIN_S)
    quoted = shlex.quote(directory)
    steps = [f"mkdir -p -- {quoted}", f"cd -- {quoted}"]
    if variables is not None:
        file = shlex.quote(variables)
        # command -p: the job's own PATH is in force once the file is read.
        steps += ["set -a", f". {file}", "set +a", f"command -p rm -f -- {file}"]
    # env runs timeout, never the argv: timeout takes no options after its duration.
    words = ["env", "--", "timeout", "-s", "KILL", str(seconds), *argv]
    steps.append(f"exec {shlex.join(words)} < {shlex.quote(source)}")
    return f"({' && '.join(steps)})"


def _kind(mode: str) -> FileKind:
    """What Go's ``FileMode.String()`` says an entry is (``d``, ``L`` for a link, ``-``)."""
    kinds: dict[str, FileKind] = {"-": "file", "d": "folder", "L": "link"}
    return kinds.get(mode[:1], "other")


def _absolute(path: str) -> str:
    return posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, path))
