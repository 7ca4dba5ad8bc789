"""Bad input, as a table: each gets its status and a JSON error code, nothing runs, the
relay keeps serving, and no stack trace or secret is in the answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from relay.http.routes import validation_failed
from relay.runs.models import (
    MAX_ARG_CHARS,
    MAX_ARGV_ITEMS,
    MAX_ENV_VARS,
    MAX_STDIN_BYTES,
    RunRequest,
)
from testing.relay_server import SECRET_CANARY, RelayProcess

ECHO = {"job": "echo", "params": {"message": "x"}}
PARAMS = {"job": "params", "params": {"name": "n"}}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("bad"), local_isolation="bwrap")
    server.add_token("ops", command=True)
    server.add_token("jobs-only")
    server.start()
    yield server
    server.stop()


def raw(body: str) -> bytes:
    return body.encode()


CASES: list[tuple[str, Any, int, str]] = [
    ("malformed JSON", raw('{"job": "echo",'), 400, "invalid_json"),
    ("not UTF-8", b'{"job": "\xff"}', 400, "invalid_json"),
    # What Python's parser and the model's disagree on ends as it did when both looked.
    ("a NUL after the object", b'{"job": "echo"}\x00', 400, "invalid_json"),
    ("a byte-order mark", b'\xef\xbb\xbf{"job": "echo"}', 422, "validation_error"),
    (
        "a lone surrogate",
        raw('{"job": "echo", "params": {"message": "\\ud800"}}'),
        422,
        "validation_error",
    ),
    (
        "a number too long to convert",
        raw('{"job": "echo", "params": {"n": 1' + "0" * 5000 + "}}"),
        400,
        "invalid_json",
    ),
    ("JSON array", [1, 2], 400, "invalid_request"),
    ("JSON string", "echo", 400, "invalid_request"),
    ("empty object", {}, 422, "validation_error"),
    ("both job and command", {**ECHO, "command": ["id"]}, 422, "validation_error"),
    ("unknown field", {**ECHO, "jobb": 1}, 422, "validation_error"),
    ("job wrong type", {"job": 5}, 422, "validation_error"),
    ("job bad name", {"job": "../etc"}, 422, "validation_error"),
    ("unknown job", {"job": "nope"}, 422, "unknown_job"),
    ("params not an object", {"job": "echo", "params": []}, 422, "validation_error"),
    ("unknown param", {"job": "echo", "params": {"message": "x", "m2": 1}}, 422, "invalid_params"),
    ("missing required param", {"job": "echo", "params": {}}, 422, "invalid_params"),
    ("param wrong type", {"job": "echo", "params": {"message": 5}}, 422, "invalid_params"),
    (
        "string param too long",
        {"job": "echo", "params": {"message": "m" * 1001}},
        422,
        "invalid_params",
    ),
    (
        "integer param over max",
        {**PARAMS, "params": {"name": "n", "count": 11}},
        422,
        "invalid_params",
    ),
    (
        "integer param under min",
        {**PARAMS, "params": {"name": "n", "count": 0}},
        422,
        "invalid_params",
    ),
    (
        "boolean for integer",
        {**PARAMS, "params": {"name": "n", "count": True}},
        422,
        "invalid_params",
    ),
    (
        "array param too many",
        {**PARAMS, "params": {"name": "n", "tags": ["a"] * 4}},
        422,
        "invalid_params",
    ),
    (
        "array item pattern",
        {**PARAMS, "params": {"name": "n", "tags": ["a; rm -rf /"]}},
        422,
        "invalid_params",
    ),
    ("NUL in param", {"job": "echo", "params": {"message": "a\u0000b"}}, 422, "invalid_params"),
    (
        "shell metacharacters where a pattern forbids them",
        {"job": "python", "params": {"label": "$(reboot)"}},
        422,
        "invalid_params",
    ),
    ("argv empty", {"command": []}, 422, "validation_error"),
    ("argv too many items", {"command": ["echo"] * (MAX_ARGV_ITEMS + 1)}, 422, "validation_error"),
    (
        "argv item too long",
        {"command": ["echo", "a" * (MAX_ARG_CHARS + 1)]},
        422,
        "validation_error",
    ),
    ("argv not strings", {"command": ["echo", 1]}, 422, "validation_error"),
    (
        "too many env vars",
        {"command": ["env"], "env": {f"V{i}": "x" for i in range(MAX_ENV_VARS + 1)}},
        422,
        "validation_error",
    ),
    ("bad env name", {"command": ["env"], "env": {"1BAD": "x"}}, 422, "validation_error"),
    (
        "stdin too large",
        {"command": ["cat"], "stdin": "s" * (MAX_STDIN_BYTES + 1)},
        422,
        "validation_error",
    ),
    ("file path escapes", {"command": ["true"], "files": {"../x": "y"}}, 422, "validation_error"),
    (
        "absolute file path",
        {"command": ["true"], "files": {"/etc/x": "y"}},
        422,
        "validation_error",
    ),
    ("negative timeout", {"command": ["true"], "timeout_s": -1}, 422, "validation_error"),
    (
        "wildcard with hosts",
        {"command": ["true"], "egress": ["*", "a.com"]},
        422,
        "validation_error",
    ),
    ("unknown provider", {"command": ["true"], "provider": "nope"}, 422, "provider_not_enabled"),
    ("provider not enabled", {"command": ["true"], "provider": "e2b"}, 422, "provider_not_enabled"),
    ("size unknown", {"command": ["true"], "size": "huge"}, 422, "validation_error"),
    ("wait not a boolean", {**ECHO, "wait": "yes"}, 422, "validation_error"),
    ("override the job does not allow", {**ECHO, "env": {"A": "b"}}, 403, "forbidden"),
    ("widen the job's egress", {"job": "python", "egress": ["*"]}, 403, "forbidden"),
    (
        "callback without a signing secret",
        {**ECHO, "callback_url": "https://example.com/hook"},
        422,
        "callback_refused",
    ),
    (
        "callback over plain http",
        {**ECHO, "callback_url": "http://example.com/hook"},
        422,
        "callback_refused",
    ),
    ("callback not a URL", {**ECHO, "callback_url": "hook"}, 422, "callback_refused"),
    # Artifacts (issue 40): hostile paths are a clear 422, never a 500.
    (
        "artifact path climbs out",
        {"command": ["true"], "artifacts": ["../x"]},
        422,
        "validation_error",
    ),
    (
        "artifact path absolute",
        {"command": ["true"], "artifacts": ["/etc/passwd"]},
        422,
        "validation_error",
    ),
    (
        "artifact path with NUL",
        {"command": ["true"], "artifacts": ["a\x00b"]},
        422,
        "validation_error",
    ),
    (
        "artifact name of 300 characters",
        {"command": ["true"], "artifacts": ["a" * 300]},
        422,
        "validation_error",
    ),
    (
        "artifact recursive glob",
        {"command": ["true"], "artifacts": ["out/**/x"]},
        422,
        "validation_error",
    ),
    (
        "artifact the workdir itself",
        {"command": ["true"], "artifacts": ["."]},
        422,
        "validation_error",
    ),
    (
        "10,000 artifact paths",
        {"command": ["true"], "artifacts": [f"f{i}" for i in range(10_000)]},
        422,
        "validation_error",
    ),
    ("artifact not a string", {"command": ["true"], "artifacts": [1]}, 422, "validation_error"),
    (
        "artifacts on a job that does not allow them",
        {**ECHO, "artifacts": ["out.txt"]},
        403,
        "forbidden",
    ),
]


def _send(relay: RelayProcess, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    all_headers = relay.headers(relay.tokens["ops"], **(headers or {}))
    if isinstance(body, bytes):
        return httpx.post(relay.url + "/v1/runs", content=body, headers=all_headers, timeout=30)
    return httpx.post(relay.url + "/v1/runs", json=body, headers=all_headers, timeout=30)


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(("name", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_cleanly(
    relay: RelayProcess, name: str, body: Any, status: int, code: str
) -> None:
    before = relay.get(relay.tokens["ops"], "/v1/runs", limit=200).json()["runs"]
    answer = _send(relay, body)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == code and error["message"] and error["request_id"]
    assert "Traceback" not in answer.text and SECRET_CANARY not in answer.text
    assert "Value error" not in answer.text  # pydantic's wrapping, not the relay's words
    after = relay.get(relay.tokens["ops"], "/v1/runs", limit=200).json()["runs"]
    assert len(after) == len(before), "a refused request must not create a run"
    assert relay.get(None, "/healthz").status_code == 200


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ({"Idempotency-Key": "k" * 256}, 400, "invalid_request"),
        ({"Idempotency-Key": ""}, 400, "invalid_request"),
    ],
)
def test_bad_headers(relay: RelayProcess, headers: dict[str, str], status: int, code: str) -> None:
    answer = _send(relay, ECHO, headers)
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code


@pytest.mark.slow  # needs a relay process: seconds
def test_idempotency_key_at_its_limit_is_accepted(relay: RelayProcess) -> None:
    answer = _send(relay, ECHO, {"Idempotency-Key": "k" * 255})
    assert answer.status_code == 200 and answer.json()["stdout"] == "x\n"


@pytest.mark.slow  # needs a relay process: seconds
def test_limits_at_their_edge_are_accepted(relay: RelayProcess) -> None:
    body = {
        "command": [
            "python3",
            "-c",
            "import os,sys; print(len(sys.stdin.read()), len(sys.argv))",
            *["a" * MAX_ARG_CHARS] * (MAX_ARGV_ITEMS - 3),
        ],
        "env": {f"V{i}": "x" for i in range(MAX_ENV_VARS)},
        "stdin": "s" * MAX_STDIN_BYTES,
    }
    run = _send(relay, body).json()
    assert run["state"] == "succeeded", run
    assert run["stdout"] == f"{MAX_STDIN_BYTES} {MAX_ARGV_ITEMS - 2}\n"


@pytest.mark.slow  # needs a relay process: seconds
def test_bad_list_queries(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    for params in (
        {"limit": 0},
        {"limit": 201},
        {"limit": "x"},
        {"state": "nope"},
        {"cursor": "!!"},
        {"bogus": 1},
    ):
        answer = relay.get(token, "/v1/runs", **params)
        assert answer.status_code == 400, params
        assert answer.json()["error"]["code"] == "invalid_request"


def test_a_refused_request_names_each_field_and_none_of_its_values() -> None:
    hostile = "sk-" + "x" * 40
    with pytest.raises(ValidationError) as refused:
        RunRequest.model_validate({"command": ["a\x00" + hostile], "timeout_s": "soon"})
    error = validation_failed(refused.value)
    assert error.code == "validation_error" and error.status == 422
    fields = error.details["fields"]
    assert [field["field"] for field in fields] == ["command.0", "timeout_s"]
    assert error.message == f"command.0: {fields[0]['message']}"
    assert fields[0]["message"] == "must not contain a NUL character"  # "Value error, " gone
    assert hostile not in repr(error.details) and hostile not in error.message
