"""What the fake checks in a request, read from the Worker's contract.

A body is checked against ``deploy/cloudflare/openapi.yaml`` itself (``JobRequest``, or
``RunRequest`` for a two-step job's command), then for what a schema cannot say and the
Worker checks too: base64 that decodes, stdin within 1 MiB, files that clash with each other
or with the workdir. Sizes map to Cloudflare's
instance types and egress to what the Sandbox SDK can enforce exactly as the Worker maps
them (deploy/cloudflare/src/sizes.ts, egress.ts): what none holds is a 422.
"""

from __future__ import annotations

import binascii
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import yaml

DOCUMENT = Path(__file__).resolve().parents[3] / "deploy" / "cloudflare" / "openapi.yaml"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STDIN_BYTES = 1_048_576
JOB_DEFAULTS: dict[str, Any] = {"grace_s": 30, "egress": [], "size": None, "tags": {}}
COMMAND_DEFAULTS: dict[str, Any] = {"env": {}, "files": {}, "stdin": None, "workdir": None}
COMMAND_FIELDS = ("argv", "env", "files", "stdin", "workdir")


def _gb(count: int) -> int:
    return (count * 10**9) // 2**20


INSTANCE_TYPES: tuple[tuple[str, float, int, int], ...] = (
    ("lite", 1 / 16, 256, _gb(2)),
    ("basic", 1 / 4, 1024, _gb(4)),
    ("standard-1", 1 / 2, 4096, _gb(8)),
    ("standard-2", 1, 6144, _gb(12)),
    ("standard-3", 2, 8192, _gb(16)),
    ("standard-4", 4, 12288, _gb(20)),
)
"""Name, vCPUs, memory (MiB) and disk (MiB) of each type, as the Worker's sizes.ts has them."""
_LABEL = "[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"(?:\*\.)?(?:{_LABEL}\.)*{_LABEL}")


class Refused(Exception):
    """A request the Worker refuses: its status, error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@functools.cache
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(DOCUMENT.read_text())
    return loaded


@functools.cache
def validator(schema: str) -> jsonschema_rs.Draft202012Validator:
    """A validator for one of the document's schemas (its $refs resolved in the document).

    jsonschema-rs reads ``pattern`` as the Worker's JavaScript does (a final ``$`` is the
    end of the string, not also the place before a last newline, as in Python's ``re``)."""
    root = {"$ref": f"#/components/schemas/{schema}", "components": document()["components"]}
    return jsonschema_rs.Draft202012Validator(root)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _clash(paths: list[str]) -> tuple[str, str] | None:
    seen: set[str] = set()
    for path in sorted(paths):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in seen:
                return folder, path
        seen.add(path)
    return None


def _decoded(field: str, value: str, limit: int) -> bytes:
    try:
        data = binascii.a2b_base64(value, strict_mode=True)
    except binascii.Error as exc:
        raise Refused(400, "invalid_request", f"{field}: must be base64") from exc
    if len(data) > limit:
        raise Refused(400, "invalid_request", f"{field}: must be at most {limit} bytes")
    return data


def _checked(raw: bytes, schema: str) -> dict[str, Any]:
    """A JSON object the document's ``schema`` allows."""
    try:
        given = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(400, "invalid_body", "the body is not JSON") from exc
    if not isinstance(given, dict):
        raise Refused(400, "invalid_body", "the body must be a JSON object")
    errors = sorted(
        validator(schema).iter_errors(given),
        key=lambda error: [str(part) for part in error.instance_path],
    )
    if errors:
        where = ".".join(str(part) for part in errors[0].instance_path) or "body"
        raise Refused(400, "invalid_request", f"{where}: {errors[0].message[:200]}")
    return given


def _command(given: dict[str, Any]) -> dict[str, Any]:
    """A command's fields with their defaults, checked for what the schema cannot say."""
    command = {**COMMAND_DEFAULTS, **{k: given[k] for k in COMMAND_FIELDS if k in given}}
    command["timeout_s"] = given["timeout_s"]
    for path, content in command["files"].items():
        _decoded(f"files[{path!r}]", content, MAX_BODY_BYTES)
    if command["stdin"] is not None:
        _decoded("stdin", command["stdin"], MAX_STDIN_BYTES)
    clashing = _clash(list(command["files"]))
    if clashing is not None:
        raise Refused(400, "invalid_request", f"files: {clashing[0]} is a file and a folder")
    workdir = command["workdir"]
    if workdir is not None and any(
        workdir == path or workdir.startswith(path + "/") for path in command["files"]
    ):
        raise Refused(400, "invalid_request", "workdir: is one of the files")
    return command


def check_job(raw: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The body of ``POST /v1/jobs``, checked, with its defaults filled in, and its command
    (None: a two-step job, whose command comes by ``POST /v1/jobs/{id}/run``)."""
    given = _checked(raw, "JobRequest")
    command = _command(given) if "argv" in given else None
    return {**JOB_DEFAULTS, **given}, command


def check_run(raw: bytes) -> dict[str, Any]:
    """The body of ``POST /v1/jobs/{id}/run``: a two-step job's command, checked."""
    return _command(_checked(raw, "RunRequest"))


def job_id_ok(value: str) -> bool:
    return validator("JobId").is_valid(value)


def instance_type_for(size: dict[str, Any] | None, deployed: tuple[str, ...]) -> str:
    """The smallest deployed instance type that holds ``size`` (the smallest for none)."""

    def fits(kind: tuple[str, float, int, int]) -> bool:
        _, cpu, memory_mb, disk_mb = kind
        return size is None or (
            cpu >= size["cpu"] and memory_mb >= size["memory_mb"] and disk_mb >= size["disk_mb"]
        )

    for kind in INSTANCE_TYPES:
        if kind[0] in deployed and fits(kind):
            return kind[0]
    raise Refused(422, "size_unsupported", f"no deployed instance type holds {size}")


def egress_of(entries: list[str]) -> tuple[str, list[str]]:
    """``("none", [])``, ``("open", [])`` or ``("hosts", [...])``; 422 for what the SDK
    cannot express (CIDR ranges, IPv6 literals, ports)."""
    if not entries:
        return "none", []
    if "*" in entries:
        return "open", []
    hosts = [entry.lower() for entry in entries]
    for host in hosts:
        if len(host) > 253 or not _HOST.fullmatch(host):
            raise Refused(422, "egress_unsupported", f"cannot enforce {host!r}")
    return "hosts", list(dict.fromkeys(hosts))
