"""What ``/mcp`` offers a token: one tool per job it may run, ``run_command``, ``get_run``.

Each tool's input schema is built from the job's declared params (types, required,
defaults, patterns, lengths, bounds) plus the request fields the job ``allow``s, and an
optional ``idempotency_key``. The schema tells a model what to send; the relay still
checks every argument itself, as ``POST /v1/runs`` does (:func:`run_request`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from relay.auth import Principal
from relay.errors import Forbidden, InvalidParams, InvalidRequest
from relay.http.routes import validation_failed
from relay.runs.catalog import COMMAND_TOOL, GET_RUN_TOOL, Catalog, JobSpec, ParamSpec
from relay.runs.models import (
    MAX_ARG_CHARS,
    MAX_ARGV_ITEMS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_FILES,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_STDIN_BYTES,
    JobName,
    Run,
    RunRequest,
    Size,
)

IDEMPOTENCY_KEY = "idempotency_key"
MAX_ARGUMENT_DEPTH = 32
"""Deepest nesting of a tool's arguments, as of a ``POST /v1/runs`` body."""

FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "image": {"type": "string", "maxLength": 255, "description": "The sandbox image."},
    "size": {
        "type": "string",
        "enum": [size.value for size in Size],
        "description": "The sandbox size.",
    },
    "env": {
        "type": "object",
        "maxProperties": MAX_ENV_VARS,
        "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,127}$"},
        "additionalProperties": {"type": "string", "maxLength": MAX_ENV_VALUE_CHARS},
        "description": "Environment variables for the job.",
    },
    "stdin": {"type": "string", "description": f"At most {MAX_STDIN_BYTES} bytes (UTF-8)."},
    "files": {
        "type": "object",
        "maxProperties": MAX_FILES,
        "additionalProperties": {"type": "string"},
        "description": "Relative path to text content, written in the workdir.",
    },
    "workdir": {"type": "string", "maxLength": 255, "description": "A relative folder."},
    "timeout_s": {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 86_400,
        "description": "Wall-clock limit in seconds (capped by the job and the token).",
    },
    "egress": {
        "type": "array",
        "maxItems": 64,
        "items": {"type": "string", "maxLength": 253},
        "description": 'Hosts the job may reach: [] none, ["*"] all (only narrows the job\'s).',
    },
}
"""The request fields a job may ``allow``, as JSON Schema (their limits are RunRequest's)."""

IDEMPOTENCY_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_IDEMPOTENCY_KEY_CHARS,
    "description": "The same key from the same token returns the same run, never a second one.",
}
RUN_OUTPUT_SCHEMA: dict[str, Any] = Run.model_json_schema()


def param_schema(param: ParamSpec) -> dict[str, Any]:
    """One declared param as JSON Schema."""
    text: dict[str, Any] = {"type": "string"}
    if param.min_length is not None:
        text["minLength"] = param.min_length
    if param.max_length is not None:
        text["maxLength"] = param.max_length
    if param.pattern is not None:
        # The relay matches the whole value (re.fullmatch); JSON Schema searches.
        text["pattern"] = f"^(?:{param.pattern.pattern})$"
    schema: dict[str, Any]
    if param.type == "string":
        schema = text
    elif param.type == "array":
        schema = {"type": "array", "items": text}
        if param.min_items is not None:
            schema["minItems"] = param.min_items
        if param.max_items is not None:
            schema["maxItems"] = param.max_items
    elif param.type == "integer":
        schema = {"type": "integer"}
        if param.min is not None:
            schema["minimum"] = param.min
        if param.max is not None:
            schema["maximum"] = param.max
    else:
        schema = {"type": "boolean"}
    if param.description:
        schema["description"] = param.description
    if param.default is not None:
        schema["default"] = param.default
    return schema


def job_fields(job: JobSpec) -> list[str]:
    """The request fields this job's tool takes besides its params, in a stable order; a
    param of the same name hides a field."""
    fields = [name for name in FIELD_SCHEMAS if name in job.allow]
    return [name for name in [*fields, IDEMPOTENCY_KEY] if name not in job.params]


def job_schema(job: JobSpec) -> dict[str, Any]:
    """The input schema of a job's tool: its params, then the fields it allows."""
    properties = {name: param_schema(param) for name, param in job.params.items()}
    for name in job_fields(job):
        properties[name] = IDEMPOTENCY_SCHEMA if name == IDEMPOTENCY_KEY else FIELD_SCHEMAS[name]
    required = [name for name, param in job.params.items() if param.required]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


COMMAND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_ARGV_ITEMS,
            "items": {"type": "string", "maxLength": MAX_ARG_CHARS},
            "description": "The argv to run (no shell unless you name one).",
        },
        **FIELD_SCHEMAS,
        IDEMPOTENCY_KEY: IDEMPOTENCY_SCHEMA,
    },
    "required": ["command"],
    "additionalProperties": False,
}
GET_RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"run_id": {"type": "string", "maxLength": 64, "description": "A run's id."}},
    "required": ["run_id"],
    "additionalProperties": False,
}
COMMAND_DESCRIPTION = "Run a raw argv in a fresh sandbox (no job): answers with the run."
GET_RUN_DESCRIPTION = (
    "Read a run started by this token (one that outlived the wait, or any earlier one)."
)


def tool_names(principal: Principal, catalog: Catalog) -> list[str]:
    """The tools ``principal`` sees, in the order they are listed."""
    names = [name for name in catalog.jobs if principal.may_run_job(name)]
    if principal.command:
        names.append(COMMAND_TOOL)
    return [*names, GET_RUN_TOOL]


_JOB_NAME: TypeAdapter[str] = TypeAdapter(JobName)


def unlisted_refusal(name: str, principal: Principal) -> Forbidden | None:
    """Why a tool ``principal`` was not given is refused, as ``POST /v1/runs`` refuses it:
    ``run_command`` without the command scope, or any job name this token may not run,
    whether such a job exists or not (so a refusal tells nothing of other tokens' jobs).
    None: no such tool (a protocol error)."""
    if name == COMMAND_TOOL:
        return Forbidden("this token may not run a raw command")
    try:
        _JOB_NAME.validate_python(name)
    except ValidationError:
        return None
    if principal.may_run_job(name):
        return None  # a job it may run that is not there
    return Forbidden(f"this token may not run job {name!r}")


def input_schema(name: str, catalog: Catalog) -> dict[str, Any] | None:
    """The input schema of the tool called ``name`` for any token; None if there is none."""
    if name == COMMAND_TOOL:
        return COMMAND_SCHEMA
    if name == GET_RUN_TOOL:
        return GET_RUN_SCHEMA
    job = catalog.get(name)
    return job_schema(job) if job is not None else None


def _depth(value: Any) -> int:
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _refuse_unknown(arguments: dict[str, Any], known: Iterable[str], tool: str) -> None:
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise InvalidParams(f"unknown argument {unknown[0]!r} for tool {tool!r}")


def run_request(
    name: str, arguments: dict[str, Any], catalog: Catalog
) -> tuple[RunRequest, str | None]:
    """The ``POST /v1/runs`` body a tool call stands for, validated as that body is, and
    its idempotency key; raises the same RelayErrors."""
    if _depth(arguments) > MAX_ARGUMENT_DEPTH:
        raise InvalidRequest(f"the arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels")
    body: dict[str, Any] = {"wait": True}
    if name == COMMAND_TOOL:
        fields = [*COMMAND_SCHEMA["properties"]]
        _refuse_unknown(arguments, fields, name)
        body.update({k: v for k, v in arguments.items() if k != IDEMPOTENCY_KEY})
        key = arguments.get(IDEMPOTENCY_KEY)
    else:
        job = catalog.get(name)
        assert job is not None  # the caller checked
        fields = job_fields(job)
        _refuse_unknown(arguments, [*job.params, *fields], name)
        body["job"] = name
        body["params"] = {k: v for k, v in arguments.items() if k in job.params}
        body.update({k: v for k, v in arguments.items() if k in fields and k != IDEMPOTENCY_KEY})
        key = arguments.get(IDEMPOTENCY_KEY) if IDEMPOTENCY_KEY in fields else None
    if key is not None and (
        not isinstance(key, str)
        or not key
        or len(key) > MAX_IDEMPOTENCY_KEY_CHARS
        or not key.isprintable()
    ):
        raise InvalidRequest(
            f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters"
        )
    try:
        # Through JSON, as a POST body is: the same strict rules ("5" is not a number).
        return RunRequest.model_validate_json(json.dumps(body, allow_nan=False)), key
    except ValidationError as exc:
        raise validation_failed(exc) from exc
    except ValueError as exc:  # a float json cannot write (nan, inf) or a surrogate
        raise InvalidRequest("the arguments are not valid JSON values") from exc
