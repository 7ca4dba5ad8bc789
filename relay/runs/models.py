"""The API's data: what a caller sends (:class:`RunRequest`) and gets back (:class:`Run`).

These pydantic models are the single source of the request validation and of the
OpenAPI document; the limits written here are the limits the relay enforces.
"""

from __future__ import annotations

import enum
import json
import math
import posixpath
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

from relay.providers.collection import name_problem
from relay.run_state import RunState

MAX_ARGV_ITEMS = 32
MAX_ARG_CHARS = 512
MAX_ENV_VARS = 64
MAX_ENV_VALUE_CHARS = 8192
MAX_STDIN_BYTES = 65_536
MAX_FILES = 32
MAX_IDEMPOTENCY_KEY_CHARS = 255
MAX_PATH_BYTES = 1024
"""Longest ``files`` path or ``workdir`` (UTF-8 bytes): a host path must still fit PATH_MAX."""
MAX_PATH_PARTS = 32
"""Deepest ``files`` path or ``workdir``, in names (its folders and the file)."""
MAX_NAME_BYTES = 255
"""Longest single file or folder name (UTF-8 bytes), as every Linux file system has it."""
MAX_SEARCH_CHARS = 64
"""Longest ``q`` of ``GET /v1/runs``: a run id, or a job's or token's name or part of one."""
MAX_OUTCOME_HOURS = 720
"""The longest window ``GET /v1/outcomes`` reads (30 days): its cost follows the runs in it."""
MAX_ARTIFACT_PATTERNS = 32
"""Most paths and globs a job (and a request, adding to it) may declare as artifacts."""

JobName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


def _no_nul(value: str) -> str:
    # A NUL cannot pass through an argv, an environment or a path: refuse it up front.
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_CHARS), AfterValidator(_no_nul)]
EnvValue = Annotated[
    str, StringConstraints(max_length=MAX_ENV_VALUE_CHARS), AfterValidator(_no_nul)
]
EgressHost = Annotated[
    str, StringConstraints(pattern=r"^(\*|[A-Za-z0-9.:\-/\[\]]{1,253})$", max_length=253)
]


class Size(enum.StrEnum):
    """Named sandbox sizes; each provider maps them to what it can give."""

    small = "small"
    medium = "medium"
    large = "large"


SIZES: dict[Size, tuple[float, int, int]] = {
    Size.small: (1.0, 1024, 1024),
    Size.medium: (2.0, 4096, 4096),
    Size.large: (4.0, 8192, 8192),
}
"""vCPUs, memory (MiB) and disk (MiB) of each size."""


def _relative_path(value: str) -> str:
    """The normalised path, or ValueError for one that escapes, or that no file system
    could hold (a NUL, a name over 255 bytes, too long or too deep)."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    normal = posixpath.normpath(value)
    if not value or normal.startswith("/") or normal == ".." or normal.startswith("../"):
        raise ValueError("must be a relative path inside the workdir")
    if len(normal.encode("utf-8")) > MAX_PATH_BYTES:
        raise ValueError(f"must be at most {MAX_PATH_BYTES} bytes")
    parts = normal.split("/")
    if len(parts) > MAX_PATH_PARTS:
        raise ValueError(f"must be at most {MAX_PATH_PARTS} names deep (its folders and the file)")
    if any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        raise ValueError(f"each name in it must be at most {MAX_NAME_BYTES} bytes")
    return normal


def artifact_pattern(value: str) -> str:
    """An artifact path or glob, normalised (``out/./a.txt`` is ``out/a.txt``), or
    ValueError: relative and inside the workdir, as a ``files`` path; ``*``, ``?`` and
    ``[...]`` match within one name (a leading ``.`` only when written), ``**`` is refused
    (name each folder level)."""
    normal = _relative_path(value)
    if normal == ".":
        raise ValueError("names the workdir itself, not a file")
    for part in normal.split("/"):
        # What a listed name may not be, a declared one may not either: it is an entry's
        # name when nothing matches it, shown in the console like any other.
        if (problem := name_problem(part)) is not None:
            raise ValueError(f"a name in it cannot be an artifact's: {problem}")
    if "**" in normal:
        raise ValueError("** is not supported: name each folder level (out/*/*.png)")
    return normal


def path_clash(paths: Iterable[str]) -> tuple[str, str] | None:
    """Two normalised paths that cannot both be files (the same path, or one a folder of
    the other), or None."""
    seen: set[str] = set()
    for path in sorted(paths):
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if prefix in seen:
                return prefix, path
        seen.add(path)
    return None


class RunRequest(BaseModel):
    """Body of ``POST /v1/runs``. Unknown fields are refused and types are strict: a
    string is not a boolean, ``"5"`` is not a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    job: JobName | None = Field(None, description="A declared job in jobs/.")
    params: dict[str, Any] = Field(default_factory=dict, description="The job's params.")
    command: list[Arg] | None = Field(
        None,
        min_length=1,
        max_length=MAX_ARGV_ITEMS,
        description="Raw argv; only for tokens with the `command` scope.",
    )
    provider: str = Field("auto", pattern=r"^[a-z0-9_-]{1,32}$")
    image: Annotated[str, AfterValidator(_no_nul)] | None = Field(None, max_length=255)
    size: Size | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=MAX_ENV_VARS)
    stdin: str | None = Field(None, description=f"At most {MAX_STDIN_BYTES} bytes (UTF-8).")
    files: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_FILES, description="Relative path to text content."
    )
    workdir: str | None = Field(None, max_length=255)
    timeout_s: float | None = Field(None, gt=0, le=86_400)
    egress: list[EgressHost] | None = Field(None, max_length=64)
    wait: bool = True
    callback_url: str | None = Field(
        None,
        max_length=2048,
        description="https URL; the final run is POSTed there, signed (Relay-Signature).",
    )
    artifacts: list[str] = Field(
        default_factory=list,
        max_length=MAX_ARTIFACT_PATTERNS,
        description="Paths or globs (relative to the workdir) whose files are kept with the "
        "run, added to the job's own: only where the job's `allow` lists `artifacts`.",
    )

    @field_validator("artifacts")
    @classmethod
    def _artifact_patterns(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(artifact_pattern(pattern) for pattern in value))

    @field_validator("stdin")
    @classmethod
    def _stdin_size(cls, value: str | None) -> str | None:
        if value is not None and len(value.encode("utf-8")) > MAX_STDIN_BYTES:
            raise ValueError(f"stdin is over {MAX_STDIN_BYTES} bytes")
        return value

    @field_validator("files")
    @classmethod
    def _file_paths(cls, value: dict[str, str]) -> dict[str, str]:
        files: dict[str, str] = {}
        for path, content in value.items():
            normal = _relative_path(path)
            if normal == ".":
                raise ValueError(f"{path!r} names the workdir itself, not a file")
            files[normal] = content
        clash = path_clash(files)
        if clash is not None or len(files) < len(value):
            shown = f"{clash[0]!r} and {clash[1]!r}" if clash else "two paths"
            raise ValueError(f"{shown} name the same file, or a file and its folder")
        return files

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str | None) -> str | None:
        return None if value is None else _relative_path(value)

    @field_validator("egress")
    @classmethod
    def _egress(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "*" in value and value != ["*"]:
            raise ValueError('"*" must be the only entry')
        return value

    def echo(self) -> dict[str, Any]:
        """What was asked, as a run keeps and shows it (:class:`RequestEcho`): env and
        files by name, stdin by size, no callback URL; their values may be secrets."""
        shown = self.model_dump(
            mode="json", exclude={"env", "stdin", "files", "callback_url", "artifacts"}
        )
        return shown | {
            "env": sorted(self.env),
            "files": sorted(self.files),
            "stdin_bytes": len((self.stdin or "").encode()),
            **({"artifacts": self.artifacts} if self.artifacts else {}),
        }

    def echo_text(self) -> str:
        """:meth:`echo` as a run stores it: the text ``json.dumps(self.echo(),
        separators=(",", ":"))`` writes, the same characters, put together from its parts
        (the dump and the encoder's set-up cost more than the text; every run stores one).
        A request that names a job and nothing else the echo shows (its provider and
        ``wait`` aside) has the text made for the first such request (0.4 against 1.9 us)."""
        plain = not (self.params or self.env or self.files or self.artifacts or self.stdin) and (
            self.command is None
            and self.image is None
            and self.size is None
            and self.workdir is None
            and self.timeout_s is None
            and self.egress is None
        )
        if plain:  # a job by its name alone (with its provider, its wait): most runs
            key = (self.job, self.provider, self.wait)
            found = _PLAIN_ECHOES.get(key)
            if found is None:
                found = self._echo_text()
                if len(_PLAIN_ECHOES) < MAX_PLAIN_ECHOES:
                    _PLAIN_ECHOES[key] = found
            return found
        return self._echo_text()

    def _echo_text(self) -> str:
        params = "{}"
        if self.params:  # as the dump has them (a Python caller's tuple is a list there)
            params = _ECHO_JSON.encode(self.model_dump(mode="json", include={"params"})["params"])
        return "".join((
            '{"job":', _echo_value(self.job),
            ',"params":', params,
            ',"command":', "null" if self.command is None else _echo_names(self.command),
            ',"provider":', _echo_value(self.provider),
            ',"image":', _echo_value(self.image),
            ',"size":', "null" if self.size is None else _echo_value(self.size.value),
            ',"workdir":', _echo_value(self.workdir),
            ',"timeout_s":', _echo_value(self.timeout_s),
            ',"egress":', "null" if self.egress is None else _echo_names(self.egress),
            ',"wait":', _echo_value(self.wait),
            ',"env":', _echo_names(sorted(self.env)),
            ',"files":', _echo_names(sorted(self.files)),
            ',"stdin_bytes":', str(len((self.stdin or "").encode())),
            ',"artifacts":' + _echo_names(self.artifacts) if self.artifacts else "",
            "}",
        ))  # fmt: skip


_ECHO_JSON = json.JSONEncoder(separators=(",", ":"))
_PLAIN_ECHOES: dict[tuple[str | None, str, bool], str] = {}
"""The echoes of requests that set no more than a job, a provider and ``wait``, by those."""
MAX_PLAIN_ECHOES = 256
"""Plain echoes kept made (a job's name comes from the request: the memo stays bounded)."""
_json_string = json.encoder.encode_basestring_ascii  # the escaper the encoder itself uses


def _echo_value(value: Any) -> str:
    """``value`` as ``_ECHO_JSON`` writes it: the commonest kinds as its C encoder writes
    them (null, true, false, the ASCII escaper, ``float.__repr__``), anything else by it."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    kind = type(value)
    if kind is str:
        return _json_string(value)
    if kind is float and math.isfinite(value):
        return float.__repr__(value)
    return _ECHO_JSON.encode(value)


def _echo_names(names: Iterable[str]) -> str:
    """A list of strings as ``_ECHO_JSON`` writes it."""
    return "[" + ",".join(map(_json_string, names)) + "]"


class Timings(BaseModel):
    """Where the time went, in milliseconds (None: that step did not happen)."""

    create_ms: int | None = None
    first_output_ms: int | None = None
    exec_ms: int | None = None
    terminate_ms: int | None = None
    artifacts_ms: int | None = Field(
        None, description="Collecting the files its job declared, after the command ended."
    )
    pooled: bool = Field(
        False,
        description="Whether the run's sandbox came from its job's warm pool (then "
        "`create_ms` is the time to claim it).",
    )


class Artifact(BaseModel):
    """A file the run's job declared, kept with the run (or why not)."""

    name: str = Field(
        description="Its path relative to the workdir (NFC); for an entry about a whole "
        "pattern (nothing matched, more matched than listed), the pattern."
    )
    size: int = Field(0, description="Bytes kept (of a truncated file, its first ones).")
    sha256: str | None = Field(None, description="SHA-256 of the bytes kept, in hex.")
    content_type: str = Field(
        "application/octet-stream", description="Guessed from the name's extension."
    )
    truncated: bool = Field(False, description="Only its first `size` bytes were kept.")
    truncated_by: str | None = Field(
        None, description="The cap that cut it (`RELAY_ARTIFACTS_MAX_FILE_BYTES (…)`)."
    )
    skipped: str | None = Field(
        None,
        description="Why nothing of it was kept: not found, a link, a cap reached (the "
        "run's, or what the token's runs keep in all: `RELAY_ARTIFACTS_MAX_TOKEN_BYTES`), "
        "the collection cut short…",
    )
    url: str | None = Field(
        None,
        description="Where to read it, relative to the relay (`/v1/runs/{id}/artifacts/"
        "{name}`, the name percent-encoded); null when skipped.",
    )


class ErrorInfo(BaseModel):
    code: str
    message: str
    retry_after_s: float | None = Field(
        None,
        description="Seconds the provider asked the relay to wait before trying again "
        "(`provider_rate_limited`); the answer's `Retry-After` is this in whole seconds.",
    )


class RunAttempt(BaseModel):
    """One provider a run was tried on: the one that ran it (``error`` null unless the run
    ended in ``error`` there), and on a route of several, each before it that did not (a
    create that failed, a sandbox lost before the command started, or during a job that is
    ``retry = "safe"``)."""

    provider: str
    sandbox_id: str | None = Field(None, description="Its sandbox, if the create gave one.")
    error: ErrorInfo | None = Field(None, description="Why this attempt did not run the job.")
    create_ms: int | None = Field(
        None, description="From the create call (or the warm pool's claim) to its answer."
    )
    ended_at: str | None = Field(None, description="When the attempt ended.")


class DeliveryAttempt(BaseModel):
    """One POST of a webhook: the receiver's status code, or why there was none."""

    attempt: int
    at: str
    status_code: int | None = None
    error: str | None = Field(
        None, description="timeout, connection: …, dns: …, refused: … (never the answer body)"
    )
    duration_ms: int | None = None


class Delivery(BaseModel):
    """The signed POST of a finished run to its ``callback_url``."""

    id: str = Field(description="Sent as `Relay-Delivery-Id`; the same on every attempt.")
    state: Literal["pending", "delivered", "failed"]
    attempts: list[DeliveryAttempt] = Field(default_factory=list)
    next_attempt_at: str | None = Field(None, description="When a pending delivery is retried.")


class RequestEcho(BaseModel):
    """What a run was asked to do, without secrets: env variables and files by name only,
    stdin by its size, no callback URL."""

    job: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    command: list[str] | None = None
    provider: str = "auto"
    image: str | None = None
    size: Any = None
    env: list[str] = Field(default_factory=list, description="Names only, never values.")
    files: list[str] = Field(default_factory=list, description="Paths only.")
    stdin_bytes: int = 0
    workdir: str | None = None
    timeout_s: float | None = None
    egress: list[str] | None = None
    wait: bool = True
    artifacts: list[str] = Field(default_factory=list, description="Paths the request added.")


class RunSummary(BaseModel):
    """A run in a listing: every field of :class:`Run` but its output, and the output's
    size in bytes (read the output through ``GET /v1/runs/{id}``)."""

    id: str
    token: str | None = Field(None, description="The name of the token that made it.")
    job: str | None
    state: RunState
    exit_code: int | None = None
    stdout_bytes: int = Field(0, description="Size of the stored stdout, in UTF-8 bytes.")
    stderr_bytes: int = Field(0, description="Size of the stored stderr, in UTF-8 bytes.")
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    provider: str
    sandbox_id: str | None = None
    timeout_s: float
    created_at: str
    started_at: str | None = None
    ended_at: str | None = None
    duration_ms: int | None = None
    cost_usd: float = 0.0
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None
    attempts: list[RunAttempt] = Field(
        default_factory=list,
        description="Every provider the run was tried on, in order; the last one that got a "
        "sandbox is `provider`/`sandbox_id` (a route's failover: README, Routing and failover).",
    )
    deliveries: list[Delivery] = Field(
        default_factory=list, description="Webhook deliveries (runs with a `callback_url`)."
    )
    request: RequestEcho | None = Field(
        None,
        description="What was asked, as `GET /v1/runs/{run_id}` shows it; null for a run "
        "made before schema 8, and for a request over 4096 characters (large params: read "
        "it through the run).",
    )


class Run(BaseModel):
    """A run as every answer, poll and callback shows it."""

    id: str
    token: str | None = Field(None, description="The name of the token that made it.")
    job: str | None
    state: RunState
    exit_code: int | None = None
    stdout: str = Field("", description="At most `RELAY_MAX_OUTPUT_BYTES` bytes.")
    stderr: str = Field("", description="At most `RELAY_MAX_OUTPUT_BYTES` bytes.")
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    provider: str
    sandbox_id: str | None = None
    timeout_s: float
    created_at: str
    started_at: str | None = None
    ended_at: str | None = None
    duration_ms: int | None = None
    cost_usd: float = 0.0
    timings: Timings = Field(default_factory=Timings)
    error: ErrorInfo | None = None
    attempts: list[RunAttempt] = Field(
        default_factory=list,
        description="Every provider the run was tried on, in order; the last one that got a "
        "sandbox is `provider`/`sandbox_id` (a route's failover: README, Routing and failover).",
    )
    deliveries: list[Delivery] = Field(
        default_factory=list, description="Webhook deliveries (runs with a `callback_url`)."
    )
    request: RequestEcho | None = Field(
        None, description="What was asked (runs made before schema 8 have none)."
    )
    artifacts: list[Artifact] = Field(
        default_factory=list,
        description="The files its job declared (`artifacts` in job.toml, or the request's), "
        "collected before its sandbox ended.",
    )


class RunList(BaseModel):
    """``GET /v1/runs``: summaries without output, so a page costs memory in proportion
    to its ``limit``, whatever the runs printed."""

    runs: list[RunSummary]
    next_cursor: str | None = None


class ErrorDetail(BaseModel):
    code: str
    message: str
    request_id: str
    run_id: str | None = None
    fields: list[dict[str, str]] | None = None


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: ``{"error": {...}}``."""

    error: ErrorDetail


class ParamInfo(BaseModel):
    name: str
    type: Literal["string", "integer", "boolean", "array"]
    required: bool
    description: str = ""
    default: Any = None


class JobInfo(BaseModel):
    name: str
    description: str
    provider: str
    timeout_s: float
    egress: list[str]
    params: list[ParamInfo]


class JobList(BaseModel):
    jobs: list[JobInfo]


class JobsReload(BaseModel):
    """What ``POST /v1/jobs/reload`` did on the replica that answered."""

    jobs: list[str] = Field(description="Every job this replica serves now.")
    added: list[str]
    changed: list[str]
    removed: list[str]
    warnings: list[str] = Field(
        description="What still holds but may surprise: RELAY_POOL_WARM naming a job the "
        "folder no longer has (no pool for it until it comes back)."
    )


class Index(BaseModel):
    """``GET /``: where to go from here (no version, nothing secret)."""

    name: Literal["relay"] = "relay"
    docs: str = Field(description="The API reference (Swagger UI).")
    openapi: str
    console: str = Field(description="The operator console (an admin token).")
    healthz: str
    readyz: str


class ProviderInfo(BaseModel):
    name: str
    enabled: bool
    isolation: str | None = None
    limits: dict[str, str | bool] | None = None
    """Which limits the provider enforces on each sandbox (local), or that it has no hard
    lifetime of its own (sprites: ``{"hard_lifetime": false, "lifetime": "reaper"}``)."""


class ProviderList(BaseModel):
    providers: list[ProviderInfo]


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)


class UsageWindow(BaseModel):
    runs: int
    sandbox_seconds: float
    usd: float
    active: int
    pool_idle_seconds: float = Field(
        0.0,
        description="Seconds warm-pool sandboxes waited for a run, billed by the "
        "providers: of those this token's runs claimed (an admin token: the whole relay's, "
        "claimed or not). Not counted in the token's USD limits.",
    )
    pool_idle_usd: float = Field(0.0, description="What that idle time cost, in USD.")


class TokenLimits(BaseModel):
    jobs: list[str]
    command: bool
    providers: list[str]
    max_timeout_s: float | None
    max_concurrent: int | None
    runs_per_day: int | None
    usd_per_day: float | None
    max_artifact_bytes: int | None = Field(
        None,
        description="What all its runs' artifacts may keep together; null: the relay's "
        "`RELAY_ARTIFACTS_MAX_TOKEN_BYTES`.",
    )


class UsageReport(BaseModel):
    """``GET /v1/usage``: the calling token's use (UTC day and month) and its limits."""

    token: str
    today: UsageWindow
    month: UsageWindow
    limits: TokenLimits


class SpendDay(BaseModel):
    """One token's runs on one provider on one UTC day."""

    day: str = Field(description="The UTC day, YYYY-MM-DD.")
    token: str
    provider: str
    runs: int
    sandbox_seconds: float
    usd: float


class TokenSpend(BaseModel):
    """A token's usage today against its limits."""

    token: str
    admin: bool
    today: UsageWindow
    limits: TokenLimits


class SpendReport(BaseModel):
    """``GET /v1/spend``: runs and USD per day, token, provider over the last ``days``
    (every token's for an admin token, else the caller's own), and each token's standing."""

    days: int
    since: str = Field(description="The first UTC day counted, YYYY-MM-DD.")
    rows: list[SpendDay]
    tokens: list[TokenSpend]


class BreakerHealth(BaseModel):
    """A provider's breaker on this replica (README: Routing and failover)."""

    state: Literal["closed", "half_open", "open"] = Field(
        description="closed: routes try it; open: routes skip it without an attempt; "
        "half_open: past the cool-down, the next run tries it once."
    )
    consecutive_failures: int = Field(description="Failed creates in a row.")
    opened: int = Field(description="Times it opened on this replica.")
    opened_at: str | None = Field(None, description="When it last opened.")
    cooldown_left_s: float = Field(0.0, description="Until one run may try it again.")
    attempts: dict[str, int] = Field(
        default_factory=dict,
        description="Attempts of routes on it by outcome: `ok`, or the error code.",
    )
    failovers: dict[str, int] = Field(
        default_factory=dict, description="Runs that moved on from it, by the error code."
    )


class ProviderHealth(BaseModel):
    name: str
    problem: str | None = Field(None, description="Why the provider cannot serve, if so.")
    breaker: BreakerHealth | None = Field(
        None, description="Its breaker on the replica that answered (routes of several only)."
    )
    create_p50_ms: int | None = Field(
        None,
        description="Its median create time over the relay's recent runs (what a route "
        "ranked `fastest` orders by; read again at most every RELAY_ROUTE_LATENCY_REFRESH_S); "
        "null: no recent create.",
    )
    max_concurrent: int | None = Field(
        None, description="Its cap of runs at once (RELAY_<NAME>_MAX_CONCURRENT); null: none."
    )
    runs: int = Field(description="Runs on it in the last 24 hours.")
    errors: int = Field(description="Of those, runs that ended in `error` or `lost`.")
    failed: int = Field(
        0,
        description="Of those, runs that ended in any failure: `failed` (a non-zero exit), "
        "`timed_out`, `error` or `lost`.",
    )


class ReaperHealth(BaseModel):
    last_sweep_at: str | None
    sweeps: int
    terminated_by_reason: dict[str, int]
    failing: int = Field(description="Sandboxes it failed to terminate, retried each sweep.")


class WebhookHealth(BaseModel):
    pending: int
    oldest_pending_at: str | None


class SkippedPool(BaseModel):
    """A job's ``warm = N`` kept no pool: on its provider a create costs less than a claim."""

    job: str
    provider: str
    reason: str = Field(description="Why a pool would make its runs slower, not faster.")


class PoolHealth(BaseModel):
    """This replica's warm pools since it started (``relay_pool_*`` on ``/metrics``)."""

    size: int = Field(description="Sandboxes its pools keep ready, all jobs (warm = N).")
    ready: int = Field(description="Ready for a run now.")
    created: int
    claimed: int
    expired: int = Field(description="Idle past RELAY_POOL_IDLE_S, ended and replaced.")
    failed: int = Field(description="Creates that failed.")
    idle_seconds: float = Field(description="What pooled sandboxes waited, billed.")
    idle_usd: float
    skipped: list[SkippedPool] = Field(
        default_factory=list,
        description="Jobs whose warm = N keeps no sandbox here: their runs take the cold "
        "path, which on their provider is the faster one (local).",
    )


class OperatorHealth(BaseModel):
    """``GET /v1/health`` (admin tokens): what the console's health page shows."""

    status: Literal["ok", "degraded", "unavailable"]
    checks: dict[str, str]
    providers: list[ProviderHealth]
    reaper: ReaperHealth | None
    webhooks: WebhookHealth
    active_runs: int
    pools: PoolHealth


class LastFailure(BaseModel):
    """The newest run of a job (or provider) in the window that ended in a failure."""

    run_id: str
    state: RunState
    created_at: str
    exit_code: int | None = None
    error: ErrorInfo | None = None


class Outcome(BaseModel):
    """How one job's (or one provider's) runs created in the window ended."""

    name: str | None = Field(description="The job (null: raw-command runs) or the provider.")
    runs: int
    active: int = Field(description="Still queued, starting or running.")
    succeeded: int
    failed: int = Field(description="Ended in `failed`, `timed_out`, `error` or `lost`.")
    canceled: int
    success_rate: float | None = Field(
        description="succeeded / (succeeded + failed): canceled and active runs left out; "
        "null when no run ended so."
    )
    failures: dict[str, int] = Field(
        description="Failures per cause, most first: the run's `error.code`, else "
        "`exit N` (a non-zero exit), else its state (`timed_out`)."
    )
    p50_ms: int | None = Field(description="Median duration of the ended runs (nearest rank).")
    p95_ms: int | None = Field(description="95th percentile of the same.")
    usd: float
    last_failure: LastFailure | None


class OutcomeReport(BaseModel):
    """``GET /v1/outcomes`` (admin tokens): every token's runs created in the window, per
    job and per provider, busiest first (200 of each at most)."""

    hours: int
    since: str
    until: str
    jobs: list[Outcome]
    providers: list[Outcome]
    omitted: int = Field(0, description="Jobs past the 200 busiest, left out.")
