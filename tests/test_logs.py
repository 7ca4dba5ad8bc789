"""Structured logs: one JSON object per line, carrying request id, run id, token name and
provider; the caller's X-Request-Id is honoured and returned."""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from relay import logs
from relay.auth import new_token
from relay.http.app import create_app
from tests.conftest import make_settings
from tests.relay_server import SECRET_CANARY, RelayProcess


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("logs"), local_isolation="bwrap", drain_s=1)
    server.add_token("logger", command=True)
    server.start()
    yield server
    server.stop()


def lines(relay: RelayProcess) -> list[dict[str, Any]]:
    parsed = []
    for raw in relay.log().splitlines():
        line = json.loads(raw)  # every line is one JSON object
        assert {"ts", "level", "logger", "event"} <= set(line), line
        parsed.append(line)
    return parsed


def wait_for(relay: RelayProcess, test: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """All lines, once one passes ``test`` (a request's line follows its answer)."""
    deadline = time.monotonic() + 5
    while True:
        found = lines(relay)
        if any(test(line) for line in found):
            return found
        assert time.monotonic() < deadline, "the line never came"
        time.sleep(0.02)


def test_a_run_logs_its_ids_on_every_line(relay: RelayProcess) -> None:
    token = relay.tokens["logger"]
    answer = relay.post(
        token, {"job": "echo", "params": {"message": "x"}}, **{"X-Request-Id": "trace-41"}
    )
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-41"
    run_id = answer.json()["id"]
    relay.get(token, f"/v1/runs/{run_id}")
    found = wait_for(relay, lambda line: line.get("route") == "/v1/runs/{run_id}")
    mine = [line for line in found if line.get("run_id") == run_id]
    events = [line["event"] for line in mine]
    assert events[:3] == ["run submitted", "run finished", "request"], events
    for line in mine[:3]:
        assert line["request_id"] == "trace-41"
        assert (line["token"], line["job"], line["provider"]) == ("logger", "echo", "local")
    access = mine[2]
    assert access["logger"] == "relay.access"
    assert (access["method"], access["route"], access["status"]) == ("POST", "/v1/runs", 200)
    assert isinstance(access["duration_ms"], float)
    poll = mine[3]
    assert (poll["event"], poll["route"], poll["status"]) == ("request", "/v1/runs/{run_id}", 200)
    assert poll["request_id"].startswith("req_") and poll["token"] == "logger"
    assert "job" not in poll  # ids bound for one request never leak into the next


def test_request_ids_stay_with_their_own_requests(relay: RelayProcess) -> None:
    token = relay.tokens["logger"]

    def submit(n: int) -> tuple[str, str]:
        answer = relay.post(
            token,
            {"command": ["sh", "-c", "sleep 0.2; echo done"]},
            **{"X-Request-Id": f"parallel-{n}"},
        )
        return answer.headers["x-request-id"], answer.json()["id"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        pairs = dict(pool.map(submit, range(6)))
    assert set(pairs) == {f"parallel-{n}" for n in range(6)}
    by_run: dict[str, set[str]] = {}
    last = pairs["parallel-5"]
    for line in wait_for(relay, lambda line: line.get("run_id") == last and "route" in line):
        if line.get("run_id") in pairs.values():
            by_run.setdefault(line["run_id"], set()).add(line["request_id"])
    assert by_run == {run_id: {request_id} for request_id, run_id in pairs.items()}


def test_a_generated_request_id_is_returned_and_logged(relay: RelayProcess) -> None:
    too_long = "x" * 300
    answer = httpx.get(relay.url + "/v1/jobs", headers={"X-Request-Id": too_long}, timeout=5)
    assert answer.status_code == 401
    request_id = answer.headers["x-request-id"]
    assert request_id.startswith("req_") and answer.json()["error"]["request_id"] == request_id
    found = wait_for(relay, lambda line: line.get("request_id") == request_id)
    [line] = [line for line in found if line.get("request_id") == request_id]
    assert (line["route"], line["status"], line["method"]) == ("/v1/jobs", 401, "GET")
    assert "token" not in line and too_long not in relay.log()


def test_console_format_carries_the_same_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.ConsoleFormatter())
    logger = logging.getLogger("relay.test-console")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        context = logs.fresh_context()
        logs.bind(request_id="req_1", token="ops")
        logger.warning("something", extra={"run_id": "run_9", "body": "never shown"})
        logs.restore(context)
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
    first, second = stream.getvalue().splitlines()
    assert first == "warning relay.test-console: something request_id=req_1 run_id=run_9 token=ops"
    assert second == "warning relay.test-console: after"


def test_other_libraries_chatter_is_dropped_and_known_secrets_blanked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.configure("debug", "json")
        logs.redact(["sk-provider-key-1", "tiny"])
        logging.getLogger("httpcore2.http11").debug("headers [(b'Authorization', b'sk-…')]")
        logging.getLogger("some_sdk").warning("the SDK warns")
        logging.getLogger("relay.providers.x").info("oops sk-provider-key-1 was here")
        logging.getLogger("relay.service").debug("a relay debug line")
    finally:
        root.handlers[:], root.level = saved
    written = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in written] == [
        "the SDK warns",
        "oops [redacted] was here",
        "a relay debug line",
    ]


def test_a_500_logs_its_stack_without_values(tmp_path: Path) -> None:
    """The unexpected error's class and frames are logged; its message, the frame locals,
    the body and the token are not (the message may quote any of them)."""

    def lookup(body: bytes, token: str) -> None:
        held = {"token": token, "body": body}  # a frame local that must not be logged
        raise KeyError(f"{held} {SECRET_CANARY}")

    async def broken(request: Request) -> Response:
        try:
            lookup(await request.body(), request.headers["authorization"])
        except KeyError as error:
            raise RuntimeError(f"wrapped {SECRET_CANARY}") from error
        return Response()

    settings = make_settings(tmp_path)
    token = new_token(settings.tokens_file, "boom")
    app = create_app(settings)
    app.router.routes.insert(0, Route("/boom", broken, methods=["POST"]))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("relay.app")
    logger.addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            answer = client.post(
                "/boom",
                content=b"body-marker-55 " + SECRET_CANARY.encode(),
                headers={"Authorization": f"Bearer {token}"},
            )
    finally:
        logger.removeHandler(handler)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal"
    [line] = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert line["event"] == "unhandled error" and line["error_class"] == "RuntimeError"
    stack = line["traceback"]
    assert "builtins.RuntimeError" in stack and "builtins.KeyError" in stack
    assert "in lookup" in stack and "in broken" in stack and "test_logs.py" in stack
    for secret in (SECRET_CANARY, token, "body-marker-55", "Bearer"):
        assert secret not in stream.getvalue(), secret
