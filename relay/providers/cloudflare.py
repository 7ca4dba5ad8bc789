"""Cloudflare Sandboxes, through the relay's own job Worker (deploy/cloudflare), with httpx.

A Cloudflare sandbox can only be driven from a Worker in the operator's account (the Sandbox
SDK runs inside workerd), so the relay ships that Worker and speaks its HTTP contract,
``deploy/cloudflare/openapi.yaml`` (1.2.0): no SDK. Mapping (docs/providers/cloudflare.md):

* a sandbox is a two-step job: ``POST /v1/jobs`` without a command starts its container and
  answers once it is up; the command (argv, env, files, stdin, workdir) goes once, with
  ``POST /v1/jobs/{id}/run``; ``DELETE /v1/jobs/{id}`` ends it and answers 200 only once the
  destroy is confirmed (its 202 is a failed terminate: the Worker's alarm retries it, and the
  reaper, which finds it listed until then);
* lifetime: every create carries the run's ``timeout_s`` and ``grace_s``, and the Worker's
  alarm destroys the container at ``created + timeout_s + grace_s`` whatever the relay does;
* id: ``<run id>-<6 hex>``, chosen before the create, so what a failed create left is deleted
  by that id; the cluster and run tags go with the create, and the reaper lists
  ``GET /v1/jobs?tag=relay-cluster=…``;
* size → the smallest Cloudflare instance type that holds it (lite … standard-4), else 422;
* egress: ``[]`` no network, ``["*"]`` the public internet, host names and IPv4 addresses an
  allow-list (HTTP and HTTPS); CIDR ranges, IPv6 and ports → 422, never widened;
* artifacts: a two-step job's container is kept after its command, and its files are read
  with ``GET /v1/jobs/{id}/files?path=`` (one folder, links listed as links) and
  ``GET /v1/jobs/{id}/file?path=&limit=`` (the bytes, streamed, the Worker stopping at the
  cap), paths relative to /workspace;
* output: the NDJSON event stream, followed again from the last event seen (``?after=N``)
  when it is cut; text as UTF-8;
* auth fails closed here too: no URL or key, no start; the key only in the Authorization
  header, never in a URL, and only to https (or loopback); before its first create or
  listing the provider checks that the Worker refuses a request without the key, and refuses
  a Worker that answers one (Cloudflare's Sandbox Bridge does, with its key unset).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import posixpath
import re
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict

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
from relay.providers.lifecycle import TIMEOUT_MARGIN_S, ErrorTable, ProviderSandbox, SandboxProvider
from relay.settings import ProviderSettings, Settings

log = logging.getLogger("relay.providers.cloudflare")


def _gb(count: int) -> int:
    """Disk is in GB (10^9 bytes) on Cloudflare's limits page, and in MiB here, rounded down."""
    return (count * 10**9) // 2**20


INSTANCE_TYPES: tuple[tuple[str, float, int, int], ...] = (
    ("lite", 1 / 16, 256, _gb(2)),
    ("basic", 1 / 4, 1024, _gb(4)),
    ("standard-1", 1 / 2, 4096, _gb(8)),
    ("standard-2", 1, 6144, _gb(12)),
    ("standard-3", 2, 8192, _gb(16)),
    ("standard-4", 4, 12288, _gb(20)),
)
"""Name, vCPUs, memory and disk (MiB) of each type (developers.cloudflare.com/containers/
platform/limits/), as the Worker's src/sizes.ts has them."""
MAX_TIMEOUT_S = 86_400.0
MAX_GRACE_S = 3_600.0
"""The Worker's bounds on a job's ``timeout_s`` and ``grace_s``."""
MAX_FILES_BASE64 = 15 * 1024 * 1024
"""The run's files, base64, within the Worker's 16 MiB body."""
MAX_CUTS = 5
"""A command's event stream that breaks this many times in a row with no new event fails."""
_LABEL = "[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"(?:\*\.)?(?:{_LABEL}\.)*{_LABEL}")
_CODE = re.compile(r"[a-z_]{1,40}")
_LOOPBACK = frozenset({"localhost"})
_ENDINGS = {
    "timed_out": "the Cloudflare job reached its deadline during the run",
    "canceled": "the Cloudflare job was deleted during the run",
    "lost": "the Cloudflare Worker lost the command (its Durable Object restarted)",
}
_STREAMS: tuple[StreamName, ...] = ("stdout", "stderr")
_CONNECT_S = 10.0
_READ_S = 30.0
_STREAM = httpx.Timeout(_READ_S, connect=_CONNECT_S, read=45.0)  # a ping every 15 s
_STARTING = httpx.Timeout(_READ_S, connect=_CONNECT_S, read=None)  # the create's Deadline bounds it


def instance_type_for(size: Resources) -> str:
    """The smallest instance type that holds ``size``, or :class:`SizeUnsupported`."""
    for name, cpu, memory_mb, disk_mb in INSTANCE_TYPES:
        if cpu >= size.cpu and memory_mb >= size.memory_mb and disk_mb >= size.disk_mb:
            return name
    raise SizeUnsupported(
        "Cloudflare containers have at most 4 vCPUs, 12 GiB of memory and 20 GB of disk"
    )


def egress_for(hosts: tuple[str, ...]) -> list[str]:
    """The Worker's ``egress``: ``[]``, ``["*"]``, or host names and IPv4 addresses; what the
    Sandbox SDK cannot enforce is :class:`EgressUnsupported`, never widened."""
    if hosts == ("*",):
        return ["*"]
    allowed: list[str] = []
    for host in hosts:
        name = host.lower()
        if name == "*" or len(name) > 253 or not _HOST.fullmatch(name):
            raise EgressUnsupported(
                "Cloudflare's outbound rules take host names (or *.domain) and IPv4 addresses, "
                'not CIDR ranges, IPv6 addresses, ports, or "*" beside other hosts'
            )
        allowed.append(name)
    return allowed


def job_id_for(spec: SandboxSpec) -> str:
    """A new job id for the run: the Worker's id rule, unique per create."""
    run = re.sub(r"[^a-z0-9_.-]+", "-", spec.run_id.lower()).strip("-_.")[:48].rstrip("-_.")
    return f"{run or 'run'}-{secrets.token_hex(3)}"


def worker_url(url: str) -> str:
    """The Worker's URL, https unless it is on this machine (the key must not cross a
    network in the clear)."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
    except ValueError as exc:
        raise ConfigError("RELAY_CLOUDFLARE_URL is not a URL") from exc
    loopback = host in _LOOPBACK
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not host or parts.scheme not in ("https", "http") or parts.username or parts.password:
        raise ConfigError("RELAY_CLOUDFLARE_URL must be the job Worker's https:// URL")
    if parts.scheme != "https" and not loopback:
        raise ConfigError("RELAY_CLOUDFLARE_URL must be https:// (the key would travel in clear)")
    return url.strip().rstrip("/")


class WorkerAnswer(Exception):
    """The Worker refused a call: its status and error code (never its message)."""

    def __init__(self, status: int, code: str, retry_after: float | None = None) -> None:
        super().__init__(f"the Worker answered {status} {code}")
        self.status, self.code, self.retry_after = status, code, retry_after

    @classmethod
    def of(cls, response: httpx.Response) -> WorkerAnswer:
        code = "unknown"
        try:
            found = response.json()["error"]["code"]
            code = found if isinstance(found, str) and _CODE.fullmatch(found) else code
        except (ValueError, KeyError, TypeError):
            pass
        try:
            retry_after: float | None = float(response.headers.get("retry-after", ""))
        except ValueError:
            retry_after = None
        return cls(response.status_code, code, retry_after)


class WorkerMalformed(Exception):
    """An answer that is not what the Worker's contract says (a proxy's page, another app)."""


def _classify(exc: BaseException) -> ProviderError | type[ProviderError] | None:
    if not isinstance(exc, WorkerAnswer):
        return None
    if exc.status in (401, 403):
        return ProviderAuth
    if exc.status == 429:
        retry_after = exc.retry_after if exc.retry_after and exc.retry_after > 0 else 5.0
        return ProviderRateLimited("Cloudflare is rate limiting the relay", retry_after=retry_after)
    if exc.status == 404 or exc.code == "job_ended":
        return SandboxLost
    return ProviderUnavailable if exc.status >= 500 else ProviderError


ERRORS: ErrorTable = (
    (WorkerAnswer, _classify),
    (WorkerMalformed, ProviderError),
    (httpx.TimeoutException, ProviderTimeout),
    ((httpx.TransportError, httpx.StreamError), ProviderUnavailable),
)


_KINDS: dict[str, FileKind] = {"file": "file", "directory": "folder", "symlink": "link"}


def _error_code(response: httpx.Response) -> str | None:
    """The Worker's error code in ``response`` (None when it is not the Worker's JSON)."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def _in_workspace(path: str) -> str:
    """A sandbox path as the Worker's file routes take it: relative to /workspace."""
    normal = posixpath.normpath(path)
    if normal == DEFAULT_WORKDIR:
        return ""
    if not normal.startswith(DEFAULT_WORKDIR + "/"):
        raise FileUnreadable("the Worker reads files under /workspace only")
    return normal.removeprefix(DEFAULT_WORKDIR + "/")


def _object(response: httpx.Response) -> dict[str, Any]:
    try:
        found = response.json()
    except ValueError as exc:
        raise WorkerMalformed("not JSON") from exc
    if not isinstance(found, dict):
        raise WorkerMalformed("not a JSON object")
    return found


def _relative(path: str) -> str | None:
    """A path under /workspace, relative to it (None: /workspace itself)."""
    full = posixpath.normpath(posixpath.join(DEFAULT_WORKDIR, path))
    if full == DEFAULT_WORKDIR:
        return None
    if not full.startswith(DEFAULT_WORKDIR + "/"):
        raise ValidationFailed(f"the cloudflare provider writes and runs under {DEFAULT_WORKDIR}")
    return full.removeprefix(DEFAULT_WORKDIR + "/")


def _result(end: Mapping[str, Any], output: OutputSink) -> ExecResult:
    """The command's end, from the stream's ``end`` line."""
    for stream in _STREAMS:
        if end.get(f"{stream}_truncated") is True:
            output.mark_truncated(stream)
    state, code = end.get("state"), end.get("exit_code")
    if state in ("exited", "timed_out") and isinstance(code, int):
        return ExecResult(exit_code=code)  # timed out with a code: its own timeout (124)
    if state == "error":
        raise ProviderUnavailable("the Cloudflare container failed under the command")
    raise SandboxLost(_ENDINGS.get(str(state), "the Cloudflare job ended without its command"))


class CloudflareSandbox(ProviderSandbox):
    """One two-step job of the Worker; its files go with its command."""

    def __init__(self, provider: CloudflareProvider, job_id: str) -> None:
        super().__init__(provider, job_id)
        self._worker = provider
        self._files: dict[str, str] = {}

    async def folder_entries(self, path: str) -> list[FileEntry]:
        return await self._worker.list_files(self.id, _in_workspace(path))

    async def file_chunks(self, path: str, limit: int, size: int | None) -> AsyncIterator[bytes]:
        async for chunk in self._worker.read_file(self.id, _in_workspace(path), limit):
            yield chunk

    async def write_files(self, files: Mapping[str, bytes]) -> None:
        for path, content in files.items():
            relative = _relative(path)
            if relative is None:
                raise ValidationFailed(f"{path!r} is the working directory, not a file")
            self._files[relative] = base64.b64encode(content).decode()
        if sum(map(len, self._files.values())) > MAX_FILES_BASE64:
            raise ValidationFailed("the files are over the Cloudflare Worker's 16 MiB request")

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
        command = {
            "argv": list(argv),
            "env": dict(env),
            "files": self._files,
            "stdin": None if stdin is None else base64.b64encode(stdin).decode(),
            "workdir": None if workdir is None else _relative(workdir),
            "timeout_s": min(timeout_s + TIMEOUT_MARGIN_S, MAX_TIMEOUT_S),
        }
        await self._worker.start_command(self.id, command)
        return await self._worker.follow(self.id, output)


class CloudflareSettings(ProviderSettings):
    """``RELAY_CLOUDFLARE_*``: the job Worker's URL and its key (its ``JOB_WORKER_KEY``)."""

    model_config = SettingsConfigDict(env_prefix="RELAY_CLOUDFLARE_")

    url: str | None = None
    key: SecretStr | None = None


class CloudflareProvider(SandboxProvider[CloudflareSandbox]):
    """Runs each job in a Cloudflare container through the relay's job Worker."""

    name: ClassVar[str] = "cloudflare"
    label: ClassVar[str] = "Cloudflare"
    # developers.cloudflare.com/containers/pricing (rates read 2026-08-03; CPU is billed on
    # active use since 2025-11-21, memory on the instance type's while it runs): $0.00002
    # per vCPU-second, $0.0000025 per GiB-second. Counting every second as active CPU
    # gives an upper bound for CPU; disk ($0.00000007 per GB-second) is not counted.
    rate: ClassVar[Rate] = Rate(0.00002, 0.0000025)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = CloudflareSettings
    terminate_timeout_s: ClassVar[float] = 30.0  # the Worker bounds its destroy at 20 s

    def __init__(self, settings: Settings) -> None:
        config = settings.section(CloudflareSettings)
        if not config.url or config.key is None or not config.key.get_secret_value():
            raise ConfigError(
                "the cloudflare provider needs RELAY_CLOUDFLARE_URL (the job Worker's URL, "
                "deploy/cloudflare) and RELAY_CLOUDFLARE_KEY (its JOB_WORKER_KEY)"
            )
        self._url = worker_url(config.url)
        # trust_env off: no proxy, netrc or certificate setting from the environment steers
        # where the key goes. Each running command holds a connection for its stream.
        self._client = httpx.AsyncClient(
            base_url=self._url,
            headers={"authorization": f"Bearer {config.key.get_secret_value()}"},
            timeout=httpx.Timeout(_READ_S, connect=_CONNECT_S),
            limits=httpx.Limits(max_connections=max(100, 4 * settings.max_concurrent)),
            follow_redirects=False,
            trust_env=False,
        )
        self._cluster = settings.cluster
        self.create_timeout_s = settings.create_timeout_s
        self._attempts: dict[str, list[str]] = {}
        """The job ids each run's creates used, until the create is over (a sweep's)."""
        self._refuses_strangers = False

    def check(self, spec: SandboxSpec) -> None:
        egress_for(spec.egress.hosts)
        instance_type_for(spec.resources)
        if spec.pip:
            raise ValidationFailed(
                "the cloudflare provider does not install pip packages; add them to the "
                "job Worker's Dockerfile"
            )
        if spec.image is not None:
            raise ValidationFailed(
                "Cloudflare containers run the job Worker's one image; leave the job's image "
                "unset for cloudflare"
            )
        if spec.timeout_s > MAX_TIMEOUT_S or spec.grace_s > MAX_GRACE_S:
            raise ValidationFailed("the Cloudflare Worker takes timeouts of at most a day")

    async def _verify(self) -> None:
        """Refuse a Worker that answers a request without the key (once it has refused one,
        for the life of this client)."""
        if self._refuses_strangers:
            return
        request = self._client.build_request("GET", "/v1/jobs", params={"limit": "1"})
        del request.headers["authorization"]
        response = await self._client.send(request)
        if response.status_code in (401, 403):
            self._refuses_strangers = True
            return
        if response.status_code == 429 or response.status_code >= 500:
            raise WorkerAnswer.of(response)
        log.error(
            "cloudflare: the Worker at %s answered a request without its key (%d); refusing it",
            self._url,
            response.status_code,
        )
        raise ProviderAuth(
            "the Cloudflare Worker answers requests without its key (it fails open); deploy "
            "the relay's job Worker (deploy/cloudflare) and set its JOB_WORKER_KEY"
        )

    async def create(self, spec: SandboxSpec) -> CloudflareSandbox:
        await self._verify()
        job_id = job_id_for(spec)
        size = spec.resources
        body = {
            "id": job_id,
            "timeout_s": spec.timeout_s,
            "grace_s": spec.grace_s,
            "egress": egress_for(spec.egress.hosts),
            "size": {"cpu": size.cpu, "memory_mb": size.memory_mb, "disk_mb": size.disk_mb},
            "tags": spec.tags,
        }
        # Known before the call: a create that fails or never answers is swept by it.
        self._attempts.setdefault(spec.run_id, []).append(job_id)
        response = await self._client.post("/v1/jobs", json=body, timeout=_STARTING)
        if response.status_code in (401, 403, 422, 429):
            self._attempts.pop(spec.run_id, None)  # refused: nothing was made, nothing to sweep
        if response.status_code == 422:
            refused = WorkerAnswer.of(response)
            if refused.code == "size_unsupported":
                raise SizeUnsupported("no instance type this Cloudflare Worker deploys holds it")
            if refused.code == "egress_unsupported":
                raise EgressUnsupported("the Cloudflare Worker cannot enforce this egress")
            raise refused
        if response.status_code not in (200, 201):
            raise WorkerAnswer.of(response)
        if _object(response).get("state") != "ready":
            raise ProviderUnavailable("the Cloudflare container did not start")
        self._attempts.pop(spec.run_id, None)
        return CloudflareSandbox(self, job_id)

    async def left_by_create(self, spec: SandboxSpec) -> list[str]:
        return self._attempts.pop(spec.run_id, [])

    async def start_command(self, job_id: str, command: Mapping[str, Any]) -> None:
        """Give the job its command; the same body again is the same run, so a call whose
        answer was lost is sent once more."""
        for attempt in (1, 2):
            try:
                response = await self._client.post(f"/v1/jobs/{job_id}/run", json=command)
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
        if response.status_code not in (200, 202):
            raise WorkerAnswer.of(response)

    async def follow(self, job_id: str, output: OutputSink) -> ExecResult:
        """The command's output into ``output`` until its end, following a cut stream on
        from the last event seen."""
        after, cuts = 0, 0
        while True:
            try:
                path = f"/v1/jobs/{job_id}/events"
                params = {"after": str(after)}
                async with self._client.stream("GET", path, params=params, timeout=_STREAM) as got:
                    if got.status_code != 200:
                        await got.aread()
                        raise WorkerAnswer.of(got)
                    async for line in got.aiter_lines():
                        event = json.loads(line) if line.strip() else {}
                        kind = event.get("type")
                        if kind in ("stdout", "stderr") and event["seq"] > after:
                            output.write(kind, str(event["data"]).encode())
                            after, cuts = int(event["seq"]), 0
                        elif kind == "end":
                            return _result(event, output)
            except httpx.TransportError as exc:
                cause: Exception = exc
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise WorkerMalformed("an event that is not the contract's") from exc
            else:
                cause = ProviderUnavailable("the event stream ended without its end")
            cuts += 1
            if cuts >= MAX_CUTS:
                raise ProviderUnavailable("the Cloudflare event stream kept breaking") from cause
            log.info(
                "cloudflare job %s: event stream cut after event %d; following on", job_id, after
            )
            await asyncio.sleep(0.1 * cuts)

    async def list_files(self, job_id: str, path: str) -> list[FileEntry]:
        """A kept container's folder (``path`` relative to /workspace)."""
        response = await self._client.get(f"/v1/jobs/{job_id}/files", params={"path": path})
        if response.status_code == 404 and _error_code(response) == "no_such_path":
            raise FileUnreadable("no such folder")
        if response.status_code != 200:
            raise WorkerAnswer.of(response)
        try:
            listed = response.json()["files"]
            return [
                FileEntry(
                    str(entry["name"]), _KINDS.get(entry["type"], "other"), int(entry["size"])
                )
                for entry in listed
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkerMalformed("the Worker's file listing is not its contract's") from exc

    async def read_file(self, job_id: str, path: str, limit: int) -> AsyncIterator[bytes]:
        """A kept container's file, at most ``limit`` bytes, streamed."""
        params = {"path": path, "limit": str(limit)}
        async with self._client.stream(
            "GET", f"/v1/jobs/{job_id}/file", params=params, timeout=_STREAM
        ) as response:
            if response.status_code == 404:
                await response.aread()
                if _error_code(response) == "no_such_path":
                    raise FileUnreadable("no such file")
            if response.status_code != 200:
                await response.aread()
                raise WorkerAnswer.of(response)
            async for chunk in response.aiter_bytes():
                yield chunk

    async def destroy(self, sandbox_id: str) -> None:
        response = await self._client.delete(f"/v1/jobs/{sandbox_id}")
        if response.status_code == 202:
            raise ProviderUnavailable(
                "the Cloudflare Worker has not confirmed the destroy yet (its alarm retries it)"
            )
        if response.status_code != 200:
            raise WorkerAnswer.of(response)  # 404: gone already, which is success

    async def gone(self, sandbox_id: str) -> bool:
        try:
            response = await self._client.get(f"/v1/jobs/{sandbox_id}")
            return response.status_code == 404 or (
                response.status_code == 200 and _object(response).get("destroyed_at") is not None
            )
        except (httpx.HTTPError, WorkerMalformed):
            return False

    async def list_tagged(self) -> list[SandboxRef]:
        await self._verify()
        owned: list[SandboxRef] = []
        cursor: str | None = None
        while True:
            params = {"tag": f"{TAG_CLUSTER}={self._cluster}", "limit": "1000"}
            if cursor:
                params["cursor"] = cursor
            response = await self._client.get("/v1/jobs", params=params)
            if response.status_code != 200:
                raise WorkerAnswer.of(response)
            try:
                page = _object(response)
                for entry in page["jobs"]:
                    tags = entry["tags"]
                    if tags.get(TAG_CLUSTER) != self._cluster:
                        continue  # the filter is the Worker's; check it here too
                    created = datetime.fromisoformat(entry["created_at"].replace("Z", "+00:00"))
                    owned.append(SandboxRef(str(entry["id"]), tags.get(TAG_RUN), created))
                cursor = page["next_cursor"]
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise WorkerMalformed("a listing that is not the contract's") from exc
            if not cursor:
                return owned

    async def aclose(self) -> None:
        await self._client.aclose()
