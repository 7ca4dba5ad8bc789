"""The relay's one settings object, read from ``RELAY_*`` variables and ``.env``.

Built once (``Settings()``) and passed down; no other module reads ``os.environ``.
Secrets are :class:`pydantic.SecretStr`, so they print as ``**********``.

A cloud provider's own settings (keys, URLs) live next to its code, as a
:class:`ProviderSettings` model read from ``RELAY_<PROVIDER>_*`` the same way; the
provider asks for its part with :meth:`Settings.section`.
"""

from __future__ import annotations

import contextlib
from ipaddress import IPv4Network
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError


class ProviderSettings(BaseSettings):
    """A provider's own settings, declared in its module with its ``env_prefix``
    (``RELAY_E2B_``); built by :meth:`Settings.section`, never read on its own."""

    model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore")

    max_concurrent: int | None = Field(None, ge=1)
    """Runs at once on this provider across the replicas (``RELAY_<NAME>_MAX_CONCURRENT``;
    None: no cap): relay/runs/capacity.py."""

    @classmethod
    def keyword_prefix(cls) -> str:
        """How its fields are named as keywords of :class:`Settings` (``e2b_``)."""
        return str(cls.model_config.get("env_prefix", "")).lower().removeprefix("relay_")


Section = TypeVar("Section", bound=ProviderSettings)

DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> str:
    """The origin of an http(s) URL as a browser writes it in ``Origin``: lower-case scheme
    and host, the port only when it is not the scheme's default (``https://a.example``);
    raises ValueError for anything else."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in DEFAULT_PORTS or not host or parts.username or parts.password:
        raise ValueError(
            f"{url!r} is not an http(s) URL with a host, like https://relay.example.com"
        )
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, bracketed as in a URL
    if port is None or port == DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


class Settings(BaseSettings):
    """Every ``RELAY_`` setting; the README and ``.env.example`` list the same ones."""

    model_config = SettingsConfigDict(
        env_prefix="RELAY_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )
    _env_file: Any = PrivateAttr(None)
    _given: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        # Kept for the providers' sections: the same .env file, and the keywords given here
        # (``Settings(e2b_api_key=...)``) winning over the environment, as for any setting.
        self._env_file = values.get("_env_file", self.model_config.get("env_file"))
        self._given = {key: value for key, value in values.items() if not key.startswith("_")}

    def section(self, model: type[Section]) -> Section:
        """A provider's settings, read from the same sources as these (a missing or
        malformed value is the model's :class:`pydantic.ValidationError`)."""
        prefix = model.keyword_prefix()
        given = {
            key.removeprefix(prefix): value
            for key, value in self._given.items()
            if key.startswith(prefix)
        }
        return model(_env_file=self._env_file, **given)

    # Serving
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    public_url: str | None = None
    """Base URL callers use (an absolute ``Location``); unset, ``Location`` is relative: a
    request's ``Host`` is the caller's and never builds a URL. Its origin is the one a browser
    page may call ``/mcp`` from (with :attr:`mcp_allowed_origins`)."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request's headers must be in this long after it began (relay/http/connections.py)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request's body must be in this long after its headers."""
    write_timeout_s: float = Field(30.0, gt=0)
    """An answer's bytes waiting for the caller to read them: past this long with none
    taken, the connection is reset (a deadline on progress, not on the whole answer)."""
    keep_alive_s: float = Field(5.0, gt=0)
    """An idle connection between requests is closed after this."""
    max_connections: int = Field(1000, ge=8)
    """Open connections; past it the oldest one with no request in flight (still sending
    its headers, or idle between requests) is closed."""

    # Auth and catalog
    tokens_file: Path = Path("tokens.toml")
    auth_header: str = "Authorization"
    jobs_dir: Path = Path("jobs")
    jobs_watch_s: float = Field(0.0, ge=0)
    """Reload the jobs folder when a file in it changes, looked at this often; 0: only on
    ``SIGHUP`` or ``relay jobs reload`` (relay/runs/jobs_folder.py)."""
    mcp_allowed_origins: Annotated[list[str], NoDecode] = []
    """Origins (``scheme://host[:port]``) besides the relay's own whose pages may call
    ``/mcp``; a request with any other ``Origin`` is refused (DNS rebinding)."""

    # State
    database_url: str = "sqlite:///relay.db"
    state_dir: Path | None = None
    """The relay's own folder (default: the SQLite file's, else the working directory)."""
    spool_max_bytes: int = Field(16 * 1024 * 1024, ge=65_536)
    """The bound of the spool (``spool`` in the state dir, relay/runs/spool.py): outcomes
    the store could not take before the relay stopped; kept reserved on disk."""

    # Providers
    providers: Annotated[list[str], NoDecode] = ["local"]
    cluster: str = Field("relay", pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    create_timeout_s: float = Field(60.0, gt=0)
    grace_s: float = Field(30.0, ge=5)

    # Runs at once on the providers with no settings model of their own; a cloud provider's
    # is its model's (ProviderSettings.max_concurrent). relay/runs/capacity.py.
    local_max_concurrent: int | None = Field(None, ge=1)
    memory_max_concurrent: int | None = Field(None, ge=1)

    # Routing and failover (relay/runs/route.py, relay/runs/breakers.py)
    route: Annotated[list[str], NoDecode] = []
    """The relay-wide route, in order: where ``provider: "auto"`` runs a job that names no
    provider of its own (and a raw command). Empty: the enabled providers, in
    ``RELAY_PROVIDERS`` order."""
    route_choice: Literal["order", "fastest", "cheapest"] = "order"
    """How a run's route is ranked where its job names no ``route`` (relay/runs/ranking.py)."""
    route_latency_refresh_s: float = Field(30.0, gt=0)
    """How often at most ``fastest`` reads the providers' recent create times again."""
    route_create_budget_s: float | None = Field(None, gt=0)
    """How long all the attempts of one run may spend getting a sandbox, together (each
    attempt's create is bounded by its provider's create timeout too). Unset: twice
    ``RELAY_CREATE_TIMEOUT_S``."""
    breaker_failures: int = Field(3, ge=1)
    """Consecutive create failures of a provider that open its breaker."""
    breaker_failure_rate: float = Field(0.5, gt=0, le=1)
    """The share of failed creates over ``RELAY_BREAKER_WINDOW_S`` (of at least twice
    ``RELAY_BREAKER_FAILURES`` creates) that opens the breaker too."""
    breaker_window_s: float = Field(60.0, gt=0)
    breaker_cooldown_s: float = Field(30.0, gt=0)
    """How long an open breaker keeps its provider out of routes before one run tries it."""

    # Limits
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_output_bytes: int = Field(1_048_576, ge=1)
    max_wait_s: float = Field(60.0, gt=0)
    max_timeout_s: float = Field(3600.0, gt=0)
    default_timeout_s: float = Field(60.0, gt=0)
    max_concurrent: int = Field(32, ge=1)
    token_share: float = Field(0.5, gt=0, le=1)
    """The part of ``max_concurrent`` one token without a ``max_concurrent`` of its own may
    hold (relay/runs/limits.py): one busy token leaves room for another."""
    max_streams_per_token: int = Field(8, ge=1)
    """Event streams (``GET /v1/runs/{id}/events``) one token may hold open at once."""
    cost_rates: dict[str, dict[str, float]] = {}
    """Per-provider overrides of the list prices, ``{"e2b": {"vcpu_s": …, "gib_s": …}}``."""

    # Artifacts (relay/runs/artifacts.py): the files a job declares, kept with its run
    artifacts_max_file_bytes: int = Field(16 * 1_048_576, ge=1)
    """Bytes kept of one file; the rest is left and the file marked ``truncated``."""
    artifacts_max_run_bytes: int = Field(16 * 1_048_576, ge=1)
    """Bytes kept of all a run's files together; past it a file is truncated, then skipped."""
    artifacts_max_token_bytes: int = Field(1_073_741_824, ge=1)
    """Bytes one token's runs keep together, counted in the store over its runs not yet
    pruned; past it a file is skipped. A token's ``max_artifact_bytes`` in the tokens file
    is its own."""
    artifacts_max_files: int = Field(64, ge=1, le=10_000)
    """Files kept of one run; further matches are listed as skipped (as many again), then
    counted."""
    artifacts_collect_s: float = Field(20.0, gt=0)
    """How long collecting a run's files may take after its command ended (never past the
    sandbox's hard lifetime); what is not read by then is listed as skipped."""
    artifacts_url: str | None = None
    """Where artifacts' contents go instead of the store: ``s3://bucket/prefix``,
    ``gs://…``, ``az://…`` or ``file:///folder`` (relay/store/objects.py; the ``objects``
    extra). Credentials and endpoint come from the provider's own variables (AWS_*, …);
    unset: the store keeps them."""
    artifacts_endpoint: str | None = None
    """An S3-compatible service's URL for RELAY_ARTIFACTS_URL's ``s3://`` bucket (MinIO,
    R2, …); plain ``http://`` is allowed only when named here."""

    # Lifecycle
    drain_s: float = Field(20.0, ge=0)
    reap_interval_s: float = Field(60.0, gt=0)
    retention_days: float = Field(30.0, ge=1)
    """Final runs older than this are deleted, with their delivery rows
    (relay/store/retention.py)."""
    prune_interval_s: float = Field(3600.0, gt=0)

    # Warm pools (relay/runs/pools.py)
    pool_warm: dict[str, Annotated[int, Field(ge=0)]] = {}
    """Per job, the operator's ``warm`` in place of the job.toml's, ``{"report": 2}``."""
    pool_max: int = Field(8, ge=0)
    """Pooled sandboxes (creating or ready) across all jobs and replicas, at most."""
    pool_idle_s: float = Field(300.0, gt=0)
    """How long a pooled sandbox waits for a run before it is terminated and replaced."""

    # Webhooks (relay/webhooks/dispatcher.py)
    webhook_secret: SecretStr | None = None
    """Signs callbacks of tokens that have no ``webhook_secret`` of their own."""
    webhook_max_attempts: int = Field(8, ge=1, le=100)
    webhook_backoff_s: float = Field(10.0, gt=0)
    """Delay before the first retry; doubled for each further one (with jitter)."""
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_poll_s: float = Field(2.0, gt=0)
    webhook_allow_http: bool = False
    webhook_allow_private: bool = False

    # Logs
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"

    # Metrics
    metrics_token: SecretStr | None = None
    """When set, ``GET /metrics`` needs ``Authorization: Bearer <it>``; else it is open."""

    # Local provider
    local_isolation: Literal["auto", "bwrap", "none"] = "auto"
    local_root: Path | None = None
    """Where local sandboxes keep their folders (default: ``sandboxes`` in the state dir)."""
    local_cgroups: bool = True
    """Give each local sandbox a cgroup (memory, processes, CPU) where the host allows."""
    local_max_memory_mb: int | None = Field(None, ge=16)
    """Cap on a local sandbox's memory, whatever its size asks."""
    local_max_disk_mb: int | None = Field(None, ge=1)
    """Cap on a local sandbox's disk (each tmpfs mount), whatever its size asks."""
    local_pids_max: int = Field(128, ge=8)
    """Processes and threads one local sandbox may have at once."""
    local_open_files: int = Field(128, ge=16)
    """Open files of each process of a local sandbox (``RLIMIT_NOFILE``)."""
    local_max_sandboxes: int = Field(32, ge=1)
    """Local sandboxes running a command at once on this relay; with the two above, a bound
    on the host's file table (relay/providers/local/file_table.py)."""
    local_uids: Annotated[tuple[int, int], NoDecode] = (700_000_000, 700_065_535)
    """The host uids a root relay gives its sandboxes, one each (``first-last``)."""
    local_network: Literal["auto", "pasta", "slirp4netns", "off"] = "auto"
    """The user-mode networking of ``egress = ["*"]`` sandboxes; ``off`` refuses them."""
    local_egress_allow: Annotated[list[IPv4Network], NoDecode] = []
    """Private or link-local ranges ``["*"]`` sandboxes may reach (host loopback never)."""

    def state_directory(self) -> Path:
        """The relay's own folder: ``RELAY_STATE_DIR``, else the SQLite file's folder, else
        the working directory (with PostgreSQL)."""
        if self.state_dir is not None:
            return self.state_dir
        with contextlib.suppress(ArgumentError):
            url = make_url(self.database_url)
            if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
                return Path(str(url.database)).absolute().parent
        return Path.cwd()

    @field_validator("providers", "route", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _routed_providers(self) -> Settings:
        # A route naming a provider that is not enabled would skip it on every run unseen.
        unknown = [name for name in self.route if name not in self.providers]
        if unknown:
            raise ValueError(
                f"RELAY_ROUTE names {unknown[0]!r}, which is not in RELAY_PROVIDERS "
                f"({', '.join(self.providers)})"
            )
        if len(set(self.route)) != len(self.route):
            raise ValueError("RELAY_ROUTE names a provider twice")
        return self

    @property
    def default_route(self) -> list[str]:
        """The relay-wide route: ``RELAY_ROUTE``, else the enabled providers in order."""
        return self.route or self.providers

    @property
    def create_budget_s(self) -> float:
        """What all of a run's attempts may spend getting a sandbox, together."""
        return self.route_create_budget_s or 2 * self.create_timeout_s

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is not None:
            origin_of(value)  # an http(s) URL with a host, or a ValueError saying why
        return value

    @field_validator("mcp_allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("mcp_allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        origins = [origin_of(url) for url in value]
        for given, origin in zip(value, origins, strict=True):
            parts = urlsplit(given.strip())
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                # A path would be ignored without a word: an Origin header never has one.
                raise ValueError(f"{given!r} is not an origin; write it as {origin!r}")
        return origins

    @field_validator("local_egress_allow", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("local_uids", mode="before")
    @classmethod
    def _split_uids(cls, value: object) -> object:
        if isinstance(value, str):
            first, dash, last = value.strip().partition("-")
            if not dash or not first.strip().isdigit() or not last.strip().isdigit():
                raise ValueError("give a range of uids as FIRST-LAST, like 700000000-700065535")
            return (int(first), int(last))
        return value

    @field_validator("local_uids")
    @classmethod
    def _sane_uids(cls, value: tuple[int, int]) -> tuple[int, int]:
        first, last = value
        # 65535 is the kernel's overflow uid and 2^32-1 its "no uid"; below 1000 are the
        # system's accounts.
        if not 1000 <= first <= last < 2**32 - 1 or (first <= 65535 and last >= 65534):
            raise ValueError("a range FIRST-LAST from 1000 to 4294967294, without 65534-65535")
        return value

    @field_validator("cost_rates")
    @classmethod
    def _known_rates(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        # A misspelt rate would leave the list price in force without a word.
        for provider, rates in value.items():
            for name, rate in rates.items():
                if name not in ("vcpu_s", "gib_s"):
                    raise ValueError(f"{provider}: {name!r} is not a rate (vcpu_s, gib_s)")
                if rate < 0:
                    raise ValueError(f"{provider}: {name} must be 0 or more")
        return value

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("enable at least one provider")
        return value
