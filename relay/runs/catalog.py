"""Declared jobs: ``jobs/<name>/job.toml`` → :class:`JobSpec`, and rendering params.

Params reach a job only as whole data, never through a shell: an argv element that is
exactly ``{name}`` becomes the param's value (an array becomes several elements), an
element with ``{name}`` inside it gets the value spliced in as text, a param with
``env = "VAR"`` is exported as that variable, and ``params_file = true`` writes every
param to ``params.json`` in the workdir. ``"; rm -rf /"`` stays one harmless argument.
See ``jobs/README.md`` for the manifest format.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from relay.errors import ConfigError, InvalidParams
from relay.providers.contract import RESERVED_ENV
from relay.runs.models import MAX_ARTIFACT_PATTERNS, SIZES, Size, artifact_pattern

ParamType = Literal["string", "integer", "boolean", "array"]
OVERRIDABLE = frozenset(
    {"image", "size", "env", "stdin", "files", "workdir", "timeout_s", "egress", "artifacts"}
)
_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
COMMAND_TOOL = "run_command"
GET_RUN_TOOL = "get_run"
RESERVED_NAMES = frozenset({COMMAND_TOOL, GET_RUN_TOOL})
"""Names no job may take: ``/mcp`` lists each job as a tool of its name beside these."""
_JOB_KEYS = {
    "description",
    "command",
    "provider",
    "providers",
    "retry",
    "route",
    "image",
    "images",
    "timeout_s",
    "size",
    "egress",
    "env",
    "files",
    "params_file",
    "allow",
    "pip",
    "params",
    "warm",
    "artifacts",
    "artifacts_required",
}
_PARAM_KEYS = {
    "type",
    "required",
    "default",
    "description",
    "min_length",
    "max_length",
    "pattern",
    "min",
    "max",
    "min_items",
    "max_items",
    "env",
    "allow_leading_dash",
}
MAX_JOB_FILE_BYTES = 1_048_576
MAX_WARM = 64
"""A job's ``warm`` at most (``RELAY_POOL_MAX`` caps all pools together anyway)."""
RANKINGS = ("order", "fastest", "cheapest")
"""How a job's ``route`` ranks its providers (relay/runs/ranking.py)."""
RETRIES = ("never", "safe")
"""A job's ``retry``: ``safe`` is the job author's promise that running it twice does no
harm, so a sandbox lost during the command may run it again on the next provider."""


@dataclass(frozen=True)
class ParamSpec:
    """One declared param and its limits."""

    name: str
    type: ParamType
    required: bool = False
    default: Any = None
    description: str = ""
    min_length: int | None = None
    max_length: int | None = None
    pattern: re.Pattern[str] | None = None
    min: int | None = None
    max: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    env: str | None = None
    allow_leading_dash: bool = False
    """A text value may start with ``-`` (otherwise refused: it could become an option)."""

    def check(self, value: Any) -> Any:
        """The value if it fits, else :class:`InvalidParams` naming the param."""
        where = f"param {self.name!r}"
        if self.type == "boolean":
            if not isinstance(value, bool):
                raise InvalidParams(f"{where} must be true or false")
            return value
        if self.type == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidParams(f"{where} must be an integer")
            if (self.min is not None and value < self.min) or (
                self.max is not None and value > self.max
            ):
                raise InvalidParams(f"{where} must be between {self.min} and {self.max}")
            return value
        if self.type == "array":
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise InvalidParams(f"{where} must be a list of strings")
            if (self.min_items is not None and len(value) < self.min_items) or (
                self.max_items is not None and len(value) > self.max_items
            ):
                raise InvalidParams(
                    f"{where} must have {self.min_items or 0} to {self.max_items} items"
                )
            for item in value:
                self._check_text(item, f"{where} item")
            return value
        if not isinstance(value, str):
            raise InvalidParams(f"{where} must be a string")
        self._check_text(value, where)
        return value

    def _check_text(self, value: str, where: str) -> None:
        if self.min_length is not None and len(value) < self.min_length:
            raise InvalidParams(f"{where} is shorter than {self.min_length} characters")
        if self.max_length is not None and len(value) > self.max_length:
            raise InvalidParams(f"{where} is longer than {self.max_length} characters")
        if "\x00" in value:
            raise InvalidParams(f"{where} contains a NUL character")
        if value.startswith("-") and not self.allow_leading_dash:
            # "--version" as a whole argv element is an option to most programs.
            raise InvalidParams(
                f"{where} starts with '-'; this param does not allow that (allow_leading_dash)"
            )
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise InvalidParams(f"{where} does not match {self.pattern.pattern!r}")


@dataclass(frozen=True)
class JobSpec:
    """A declared job: what runs, where, for how long, and what a caller may change."""

    name: str
    command: tuple[str, ...]
    description: str = ""
    provider: str = "auto"
    providers: tuple[str, ...] = ()
    """Its own route, in order (``providers = [...]``); empty: ``provider``, else the
    relay's route (``RELAY_ROUTE``)."""
    retry: str = "never"
    """``safe``: a sandbox lost after the command started may run it again elsewhere."""
    route: str | None = None
    """How its route is ranked (:data:`RANKINGS`); None: ``RELAY_ROUTE_CHOICE``."""
    image: str | None = None
    images: Mapping[str, str] = field(default_factory=dict)
    """Per-provider images (an E2B template, a registry image), overriding ``image``."""
    timeout_s: float = 60.0
    size: Size = Size.small
    egress: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, bytes] = field(default_factory=dict)
    params: Mapping[str, ParamSpec] = field(default_factory=dict)
    params_file: bool = False
    allow: frozenset[str] = frozenset()
    pip: tuple[str, ...] = ()
    warm: int = 0
    """Sandboxes kept created ahead for this job's own shape (relay/runs/pools.py)."""
    artifacts: tuple[str, ...] = ()
    """Paths and globs (relative to the workdir) whose files are kept with each run."""
    artifacts_required: bool = False
    """A run whose artifacts are not all kept whole (one missing, truncated or skipped)
    fails, though its command succeeded."""

    @property
    def route_names(self) -> tuple[str, ...]:
        """The providers the job names, in order (empty: the relay's route)."""
        if self.providers:
            return self.providers
        return () if self.provider == "auto" else (self.provider,)

    def resolve_params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise InvalidParams(f"unknown param {unknown[0]!r} for job {self.name!r}")
        values: dict[str, Any] = {}
        for name, spec in self.params.items():
            if name in given:
                values[name] = spec.check(given[name])
            elif spec.required:
                raise InvalidParams(f"param {name!r} is required")
            elif spec.default is not None:
                values[name] = spec.default
        return values

    def render(
        self, values: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, str], dict[str, bytes]]:
        """argv, env and files for these (checked) param values; no shell anywhere."""
        argv: list[str] = []
        for element in self.command:
            whole = _PLACEHOLDER.fullmatch(element)
            if whole:
                value = values.get(whole.group(1))
                if isinstance(value, list):
                    argv.extend(value)
                elif value is not None:
                    argv.append(_text(value))
                continue
            argv.append(_PLACEHOLDER.sub(lambda m: _text(values.get(m.group(1), "")), element))
        env = dict(self.env)
        for name, spec in self.params.items():
            if spec.env and name in values:
                env[spec.env] = _text(values[name])
        files = dict(self.files)
        if self.params_file:
            files["params.json"] = json.dumps(values, sort_keys=True).encode("utf-8")
        return argv, env, files


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def _suggestion(key: str, known: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the closest known key, or nothing."""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _fail(path: Path, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _parse_param(path: Path, name: str, table: Any) -> ParamSpec:
    where = f"params.{name}"
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise _fail(path, f"{where}: param names are lower-case identifiers")
    if not isinstance(table, dict):
        raise _fail(path, f"{where}: must be a table")
    extra = sorted(set(table) - _PARAM_KEYS)
    if extra:
        raise _fail(path, f"{where}.{extra[0]}: unknown field{_suggestion(extra[0], _PARAM_KEYS)}")
    for flag in ("required", "allow_leading_dash"):
        if not isinstance(table.get(flag, False), bool):
            raise _fail(path, f"{where}.{flag}: must be true or false")
    variable = table.get("env")
    if variable is not None and (
        not isinstance(variable, str) or not _ENV_NAME.fullmatch(variable)
    ):
        raise _fail(path, f"{where}.env: must be a variable name")
    if variable in RESERVED_ENV:
        raise _fail(path, f"{where}.env: {variable} is set by the relay itself")
    kind = table.get("type")
    if kind not in ("string", "integer", "boolean", "array"):
        raise _fail(path, f"{where}.type: must be string, integer, boolean or array")
    if kind == "array" and table.get("max_items") is None:
        raise _fail(path, f"{where}.max_items: an array param needs a max_items")
    if kind in ("string", "array") and table.get("max_length") is None:
        raise _fail(path, f"{where}.max_length: a text param needs a max_length")
    try:
        pattern = re.compile(table["pattern"]) if "pattern" in table else None
    except re.error as exc:
        raise _fail(path, f"{where}.pattern: not a valid regular expression ({exc})") from exc
    spec = ParamSpec(
        name=name,
        type=kind,
        required=bool(table.get("required", False)),
        default=table.get("default"),
        description=str(table.get("description", "")),
        min_length=table.get("min_length"),
        max_length=table.get("max_length"),
        pattern=pattern,
        min=table.get("min"),
        max=table.get("max"),
        min_items=table.get("min_items"),
        max_items=table.get("max_items"),
        env=variable,
        allow_leading_dash=table.get("allow_leading_dash", False),
    )
    if spec.default is not None:
        try:
            spec.check(spec.default)
        except InvalidParams as exc:
            raise _fail(path, f"{where}.default: {exc.message}") from exc
    return spec


def _route(path: Path, data: Mapping[str, Any]) -> tuple[tuple[str, ...], str, str | None]:
    """The job's ``providers`` (its route, in order), ``retry`` and ``route`` (ranking)."""
    providers = data.get("providers", [])
    if (
        not isinstance(providers, list)
        or not all(isinstance(name, str) and name for name in providers)
        or len(set(providers)) != len(providers)
    ):
        raise _fail(path, "providers: a list of provider names, in order, each once")
    if providers and data.get("provider", "auto") != "auto":
        raise _fail(path, "provider: give `provider` or `providers`, not both")
    retry = data.get("retry", "never")
    if retry not in RETRIES:
        raise _fail(path, f"retry: must be one of {', '.join(RETRIES)}")
    route = data.get("route")
    if route is not None and route not in RANKINGS:
        raise _fail(path, f"route: must be one of {', '.join(RANKINGS)}")
    return tuple(providers), retry, route


def load_job(directory: Path) -> JobSpec:
    """Read and validate one ``job.toml``; errors name the file and the field."""
    path = directory / "job.toml"
    try:
        data = tomllib.loads(path.read_text("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise _fail(path, f"not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise _fail(path, f"not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from exc
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror})") from exc
    name = directory.name
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", name):
        raise _fail(path, "the folder name is the job name: lower-case letters, digits, '-', '_'")
    if name in RESERVED_NAMES:
        raise _fail(path, f"{name!r} is the name of one of /mcp's own tools; choose another")
    extra = sorted(set(data) - _JOB_KEYS)
    if extra:
        raise _fail(path, f"{extra[0]}: unknown field{_suggestion(extra[0], _JOB_KEYS)}")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        raise _fail(path, "command: must be a non-empty list of strings (an argv, no shell)")
    params_table = data.get("params", {})
    if not isinstance(params_table, dict):
        raise _fail(path, "params: must be a table of tables")
    params = {key: _parse_param(path, key, value) for key, value in params_table.items()}
    for element in command:
        for placeholder in _PLACEHOLDER.findall(element):
            if placeholder not in params:
                raise _fail(path, f"command: {{{placeholder}}} names no declared param")
    allow = data.get("allow", [])
    if not isinstance(allow, list) or not set(allow) <= OVERRIDABLE:
        raise _fail(path, f"allow: may list only {sorted(OVERRIDABLE)}")
    try:
        size = Size(data.get("size", "small"))
    except ValueError as exc:
        raise _fail(path, f"size: must be one of {[s.value for s in SIZES]}") from exc
    timeout = data.get("timeout_s", 60)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise _fail(path, "timeout_s: must be a positive number")
    egress = data.get("egress", [])
    if not isinstance(egress, list) or ("*" in egress and egress != ["*"]):
        raise _fail(path, 'egress: a list of hosts, [] for none or ["*"] for all')
    warm = data.get("warm", 0)
    if not isinstance(warm, int) or isinstance(warm, bool) or not 0 <= warm <= MAX_WARM:
        raise _fail(path, f"warm: must be a whole number from 0 to {MAX_WARM}")
    providers, retry, route = _route(path, data)
    images = data.get("images", {})
    if not isinstance(images, dict) or not all(isinstance(v, str) for v in images.values()):
        raise _fail(path, "images: must be a table of provider name = image")
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise _fail(path, "env: must be a table of strings")
    reserved = sorted(set(env) & RESERVED_ENV)
    if reserved:
        raise _fail(path, f"env: {reserved[0]} is set by the relay itself")
    artifacts = _artifacts(path, data.get("artifacts", []))
    if not isinstance(data.get("artifacts_required", False), bool):
        raise _fail(path, "artifacts_required: must be true or false")
    files: dict[str, bytes] = {}
    for relative in data.get("files", []):
        source = (directory / relative).resolve()
        if not source.is_relative_to(directory.resolve()) or not source.is_file():
            raise _fail(path, f"files: {relative!r} is not a file in {directory}")
        if source.stat().st_size > MAX_JOB_FILE_BYTES:
            raise _fail(path, f"files: {relative!r} is over {MAX_JOB_FILE_BYTES} bytes")
        files[relative] = source.read_bytes()
    return JobSpec(
        name=name,
        command=tuple(command),
        description=str(data.get("description", "")),
        provider=str(data.get("provider", "auto")),
        providers=providers,
        retry=retry,
        route=route,
        image=data.get("image"),
        images=images,
        timeout_s=float(timeout),
        size=size,
        egress=tuple(egress),
        env=env,
        files=files,
        params=params,
        params_file=bool(data.get("params_file", False)),
        allow=frozenset(allow),
        pip=tuple(data.get("pip", [])),
        warm=warm,
        artifacts=artifacts,
        artifacts_required=data.get("artifacts_required", False),
    )


def _artifacts(path: Path, declared: Any) -> tuple[str, ...]:
    """A job's ``artifacts``, each checked and normalised as a request's are."""
    if not isinstance(declared, list) or not all(isinstance(item, str) for item in declared):
        raise _fail(path, "artifacts: must be a list of paths or globs")
    if len(declared) > MAX_ARTIFACT_PATTERNS:
        raise _fail(path, f"artifacts: at most {MAX_ARTIFACT_PATTERNS} paths or globs")
    patterns: list[str] = []
    for item in declared:
        try:
            patterns.append(artifact_pattern(item))
        except ValueError as exc:
            raise _fail(path, f"artifacts: {item!r} {exc}") from exc
    return tuple(dict.fromkeys(patterns))


class Catalog:
    """Every declared job, loaded and checked whole: at startup, and again at each reload
    (relay/runs/jobs_folder.py), which swaps all the jobs at once (:meth:`swap`).

    The relay's parts share one catalog object, so a reload reaches them all. Whoever needs
    one consistent view across an ``await`` reads :attr:`jobs` once and keeps that mapping:
    a swap replaces it, never changes it."""

    def __init__(self, jobs: Mapping[str, JobSpec]) -> None:
        self.jobs: Mapping[str, JobSpec] = dict(jobs)

    def swap(self, other: Catalog) -> None:
        """Serve ``other``'s jobs from now on, all of them at once (one assignment: a
        reader sees the old jobs or the new, never a mix)."""
        self.jobs = other.jobs

    @classmethod
    def load(cls, root: Path) -> Catalog:
        if not root.is_dir():
            raise ConfigError(f"{root}: the jobs folder does not exist (RELAY_JOBS_DIR)")
        jobs = {}
        for directory in sorted(root.iterdir()):
            if (directory / "job.toml").is_file():
                job = load_job(directory)
                jobs[job.name] = job
        return cls(jobs)

    def get(self, name: str) -> JobSpec | None:
        return self.jobs.get(name)
