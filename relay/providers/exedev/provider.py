"""The exe.dev provider: settings, error table, rate, and the VMs' create, delete and list."""

from __future__ import annotations

import asyncio
import email.utils
import math
from datetime import UTC, datetime
from typing import ClassVar, Literal

import httpx
from exedev import (
    APIError,
    AsyncClient,
    AuthenticationError,
    CommandInterruptedError,
    CommandTimeoutError,
    ExeError,
    NetworkError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    RateLimitError,
    VMNotRunningError,
    VMReadyError,
)
from pydantic import SecretStr
from pydantic_settings import SettingsConfigDict

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
from relay.providers.contract import TAG_CLUSTER, TAG_RUN, Egress, Rate, SandboxRef, SandboxSpec
from relay.providers.exedev.names import created_at_of, tags_for, tags_of, vm_name
from relay.providers.exedev.sandbox import ExedevSandbox
from relay.providers.exedev.stream import BoundedReads, Channel
from relay.providers.lifecycle import ErrorTable, SandboxProvider
from relay.settings import ProviderSettings, Settings

API_URL = "https://exe.dev"
"""exe.dev's API base (``POST {base}/exec``), the SDK's default."""
SANDBOX_CPU = 2
SANDBOX_MEMORY_MB = 4096
SANDBOX_DISK_MB = 10 * 1024
"""What each VM is: exe.dev's sandbox VM, 2 vCPU and 4 GiB (its sandbox page; the SDK's
``new()`` says 2 CPUs by default). The disk is an assumption (exe.dev does not say here)."""
LOBBY_READ_S = 35.0
"""Commands other than ``ssh`` end within exe.dev's own 30 s (the SDK's note)."""
STREAM_READ_S = 75.0
"""An ``ssh`` stream sends a blank line about every 30 s: 75 s of silence is a dead one."""
CONNECT_S = 10.0
CONFIRMS = 5
"""How many times a delete is confirmed by listing before it counts as failed."""
LIVE = frozenset({"running", "starting"})
"""VM states that can still run a command; any other (stopped, paused, gone) cannot."""
LIMITS: dict[str, str | bool] = {"hard_lifetime": False, "lifetime": "reaper"}
"""What ``GET /v1/providers`` says: exe.dev has no lifetime for a VM; the reaper deletes."""


def _caused_by(error: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    cause: BaseException | None = error
    for _ in range(5):
        if cause is None:
            return False
        if isinstance(cause, kinds):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _network(exc: BaseException) -> type[ProviderError]:
    timed_out = _caused_by(exc, (httpx.TimeoutException, TimeoutError))
    return ProviderTimeout if timed_out else ProviderUnavailable


def _not_ready(exc: BaseException) -> type[ProviderError]:
    """A VM that never answered ``ssh``: too slow, or a token that may not run ``ssh``."""
    refused = _caused_by(exc, (AuthenticationError, PermissionDeniedError))
    return ProviderAuth if refused else ProviderTimeout


def _by_status(exc: BaseException) -> type[ProviderError] | None:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status >= 500:
        return ProviderUnavailable
    return ProviderError


ERRORS: ErrorTable = (
    ((AuthenticationError, PermissionDeniedError), ProviderAuth),
    (RateLimitError, ProviderRateLimited),
    ((NotFoundError, VMNotRunningError), SandboxLost),
    (VMReadyError, _not_ready),
    (CommandTimeoutError, ProviderTimeout),
    ((CommandInterruptedError, NetworkError), _network),
    (APIError, _by_status),
    (ProtocolError, ProviderError),
    (httpx.TimeoutException, ProviderTimeout),
    ((httpx.TransportError, OSError), ProviderUnavailable),
)
"""The SDK's exceptions → the relay's. Messages are the relay's own: the SDK's carry up to
200 characters of exe.dev's error text, and its ``body`` may hold secrets."""


def egress_of(egress: Egress) -> Literal["integrations", "all"]:
    """exe.dev's policy for a run's egress, never wider: ``[]`` → ``integrations`` (only the
    account's configured integrations), ``["*"]`` → ``all``; a host list can't be said."""
    if egress.open:
        return "all"
    if egress.none:
        return "integrations"
    raise EgressUnsupported(
        "exe.dev's egress is all or only its integrations: it cannot allow a list of hosts"
    )


def check_size(spec: SandboxSpec) -> None:
    size = spec.resources
    if size.cpu > SANDBOX_CPU or size.memory_mb > SANDBOX_MEMORY_MB:
        raise SizeUnsupported(
            f"exe.dev sandboxes have {SANDBOX_CPU} vCPUs and {SANDBOX_MEMORY_MB // 1024} GiB"
        )
    if size.disk_mb > SANDBOX_DISK_MB:
        raise SizeUnsupported(f"exe.dev sandboxes have {SANDBOX_DISK_MB // 1024} GiB of disk here")


class ExedevSettings(ProviderSettings):
    """``RELAY_EXEDEV_*``: the API token, the API's URL (a fake, in tests), the default image."""

    model_config = SettingsConfigDict(env_prefix="RELAY_EXEDEV_")

    token: SecretStr | None = None
    url: str = API_URL
    image: str | None = None


class ExedevProvider(SandboxProvider[ExedevSandbox]):
    """Runs each job in a fresh exe.dev VM, deleted after the run; see docs/providers/exedev.md."""

    name: ClassVar[str] = "exedev"
    label: ClassVar[str] = "exe.dev"
    # exe.dev's sandbox page (read 2026-12-01): a 2 vCPU / 4 GiB VM at about $0.105 an hour,
    # billed per second. Split so that size costs exactly that: $0.02625 per vCPU-hour and
    # $0.013125 per GiB-hour.
    rate: ClassVar[Rate] = Rate(0.02625 / 3600, 0.013125 / 3600)
    errors: ClassVar[ErrorTable] = ERRORS
    settings_model: ClassVar[type[ProviderSettings] | None] = ExedevSettings
    limits: dict[str, str | bool] = LIMITS

    def __init__(self, settings: Settings) -> None:
        config = settings.section(ExedevSettings)
        if config.token is None:
            raise ConfigError("RELAY_EXEDEV_TOKEN is required when the exedev provider is enabled")
        self._cluster = settings.cluster
        self._image = config.image
        self.create_timeout_s = settings.create_timeout_s
        self._retry_after: float | None = None
        token = config.token.get_secret_value()
        # A create must answer (or fail) before the relay's own deadline for it: read bound
        # below it, so the SDK's shielded new() is never what a timeout waits on.
        lobby_s = min(LOBBY_READ_S, 0.75 * self.create_timeout_s)
        transport = BoundedReads(
            lobby_s=lobby_s, stream_s=STREAM_READ_S, connect_s=min(CONNECT_S, lobby_s)
        )
        timeout = httpx.Timeout(STREAM_READ_S, connect=CONNECT_S)
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=timeout,
            event_hooks={"response": [self._note_retry_after]},
        )
        # Token passed: the SDK never reads EXE_TOKEN. No retries of its own: it would wait
        # out a Retry-After (up to 60 s) inside a create it shields from cancellation.
        self._client = AsyncClient(
            token, base_url=config.url, http_client=self._http, max_retries=0
        )
        # The relay's own requests (a command's stream) go as the SDK's do.
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "text/plain",
            "Accept": "application/json, application/x-ndjson",
        }
        self._channel = Channel(self._http, config.url.rstrip("/") + "/exec", headers, timeout)

    def check(self, spec: SandboxSpec) -> None:
        egress_of(spec.egress)
        check_size(spec)
        if spec.pip:
            raise ValidationFailed(
                "the exedev provider does not install pip packages; use an image that has them"
            )

    async def create(self, spec: SandboxSpec) -> ExedevSandbox:
        vm = await self._client.new(
            name=vm_name(spec),
            tags=tags_for(spec),
            image=spec.image or self._image,
            egress=egress_of(spec.egress),
            wait_until="ssh",
            timeout=self.create_timeout_s,
        )
        return ExedevSandbox(self, vm, self._channel)

    async def left_by_create(self, spec: SandboxSpec) -> list[str]:
        """The name the create asked for: it exists if the create got that far, whatever it
        answered (late, an error, nothing); deleting a name never made is no error."""
        return [vm_name(spec)]

    async def destroy(self, sandbox_id: str) -> None:
        """``rm`` the VM, then list it until it is gone (a VM still listed is not deleted:
        the reaper tries again)."""
        summary = await self._client.delete(sandbox_id)
        if sandbox_id in summary["failed"] and sandbox_id not in summary["not_found"]:
            raise ProviderUnavailable("exe.dev did not delete the VM")
        for attempt in range(CONFIRMS):
            if all(vm.name != sandbox_id for vm in await self._client.vms(sandbox_id)):
                return
            await asyncio.sleep(0.2 * (attempt + 1))
        raise ProviderUnavailable("exe.dev still lists the VM after deleting it")

    async def gone(self, sandbox_id: str) -> bool:
        try:
            vms = await self._client.vms(sandbox_id)
        except (ExeError, httpx.HTTPError):
            return False
        return all(vm.name != sandbox_id or vm.status not in LIVE for vm in vms)

    async def list_tagged(self) -> list[SandboxRef]:
        """Every VM named under ``<cluster>-`` whose tags say it is this cluster's (a cluster
        named ``<cluster>-x`` shares the prefix)."""
        owned: list[SandboxRef] = []
        for vm in await self._client.vms(f"{self._cluster}-*"):
            tags = tags_of(vm.tags)
            if tags.get(TAG_CLUSTER) != self._cluster:
                continue
            created: datetime | None = vm.created_at or created_at_of(tags)
            owned.append(SandboxRef(vm.name, tags.get(TAG_RUN), created_at=created))
        return owned

    def mapped(self, exc: BaseException, action: str, *, in_sandbox: bool = True) -> ProviderError:
        """As the table says; a 429 with exe.dev's own Retry-After (the SDK drops it)."""
        error = super().mapped(exc, action, in_sandbox=in_sandbox)
        if isinstance(error, ProviderRateLimited) and self._retry_after is not None:
            return ProviderRateLimited(error.message, retry_after=self._retry_after)
        return error

    async def _note_retry_after(self, response: httpx.Response) -> None:
        if response.status_code == 429:
            self._retry_after = retry_after_of(response.headers.get("retry-after"))

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._http.aclose()


def retry_after_of(value: str | None) -> float:
    """Seconds from a Retry-After header (seconds or an HTTP date), at least 1; 5 if absent."""
    if not value:
        return ExedevProvider.retry_after_s
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return ExedevProvider.retry_after_s
        seconds = (when.astimezone(UTC) - datetime.now(UTC)).total_seconds()
    return max(1.0, seconds) if math.isfinite(seconds) else ExedevProvider.retry_after_s
