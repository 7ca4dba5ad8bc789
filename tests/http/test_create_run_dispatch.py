"""``POST /v1/runs`` is served by the relay's request middleware, not Starlette's router
(relay/http/app.py): its errors must answer as every routed request's do."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from relay import logs
from relay.auth import new_token
from relay.errors import UnknownJob
from relay.http.app import create_app
from tests.conftest import make_settings


def _raise(error: Exception) -> Any:
    async def raising(*args: object, **kwargs: object) -> Any:
        raise error

    return raising


@pytest.mark.parametrize(
    "error",
    [RuntimeError("boom"), sqlite3.OperationalError("database is locked"), UnknownJob("no job x")],
    ids=["unexpected", "store failure", "relay error"],
)
def test_post_v1_runs_answers_an_error_as_a_routed_request_does(
    tmp_path: Path, error: Exception
) -> None:
    settings = make_settings(tmp_path)
    token = new_token(settings.tokens_file, "ops", command=True)
    auth = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        service = client.app.state.relay.service  # type: ignore[attr-defined]
        service.submit = service.list = _raise(error)
        served = client.post("/v1/runs", json={"command": ["true"]}, headers=auth)
        routed = client.get("/v1/runs", headers=auth)
    assert served.status_code == routed.status_code != 200
    served_body, routed_body = served.json(), routed.json()
    assert served_body["error"].pop("request_id") and routed_body["error"].pop("request_id")
    assert served_body == routed_body
    names = {name for name in served.headers if name not in ("content-length", "ratelimit")}
    assert names == set(routed.headers) - {"content-length"}


@pytest.mark.parametrize(
    ("name", "good", "bad", "refused"),
    [
        ("authorization", "Bearer {token}", "Bearer rly_not_a_token", 401),
        ("idempotency-key", "nightly-1", "x" * 256, 400),
        ("content-type", "application/json", "text/plain", 415),
    ],
)
@pytest.mark.parametrize("root_path", ["", "/relay"], ids=["served", "routed"])
def test_post_v1_runs_reads_a_header_sent_twice_by_its_first_value_as_starlette_does(
    tmp_path: Path, name: str, good: str, bad: str, refused: int, root_path: str
) -> None:
    # POST /v1/runs looks its headers up in one dict (relay/http/routes.py `first_headers`),
    # served by the middleware or, under a root path, by the router: each must read the
    # value Starlette's `Request.headers` reads, the first, as every other route does.
    settings = make_settings(tmp_path)
    token = new_token(settings.tokens_file, "ops", command=True)
    good, bad = good.format(token=token), bad.format(token=token)
    auth = [] if name == "authorization" else [("authorization", f"Bearer {token}")]
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False, root_path=root_path) as client:
        service = client.app.state.relay.service  # type: ignore[attr-defined]
        service.submit = _raise(UnknownJob("no job x"))  # 422 unknown_job: it got this far
        statuses = [
            client.post(
                "/v1/runs", json={"job": "echo"}, headers=[*auth, (name, first), (name, second)]
            ).status_code
            for first, second in ((good, bad), (bad, good))
        ]
    assert statuses == [422, refused]  # the first value taken: the run reached the service


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """The relay's JSON lines, written to a StringIO instead of stderr; undone after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logs.RelayLogger.sink
    logs.configure("info", "json")
    stream = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    yield stream
    root.handlers[:], level, logs.RelayLogger.sink = saved
    root.setLevel(level)


def test_a_crash_in_post_v1_runs_is_answered_logged_and_raised_as_a_routed_crash_is(
    tmp_path: Path, log_lines: io.StringIO
) -> None:
    # POST /v1/runs skips Starlette's error middleware (relay/http/app.py `RelayApp`): its
    # request context plays that part for it, and must play it the same way: the 500 with
    # the request id, its headers, the access line then the "unhandled error" line, and the
    # error raised on to the server.
    settings = make_settings(tmp_path)
    token = new_token(settings.tokens_file, "ops", command=True)
    auth = {"Authorization": f"Bearer {token}"}
    seen: dict[str, tuple[Any, ...]] = {}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        service = client.app.state.relay.service  # type: ignore[attr-defined]
        service.submit = service.list = _raise(RuntimeError("boom"))
        for name in ("served", "routed"):
            log_lines.seek(0)
            log_lines.truncate()
            if name == "served":
                answer = client.post("/v1/runs", json={"command": ["true"]}, headers=auth)
            else:
                answer = client.get("/v1/runs", headers=auth)
            lines = [json.loads(raw) for raw in log_lines.getvalue().splitlines()]
            error = answer.json()["error"]
            assert error.pop("request_id").startswith("req_")
            seen[name] = (
                answer.status_code,
                error,
                sorted(answer.headers),
                [(line["event"], line.get("status"), line.get("error_class")) for line in lines],
                [sorted(line) for line in lines],
            )
    assert seen["served"][0] == 500
    assert seen["served"][3] == [("request", 500, None), ("unhandled error", None, "RuntimeError")]
    # The routed request's access line names its route and no token (the service raised
    # before); the run's names the token it authenticated: only those fields differ.
    served, routed = seen["served"], seen["routed"]
    assert served[:4] == routed[:4]
    assert [set(keys) - {"token"} for keys in served[4]] == [
        set(keys) - {"token"} for keys in routed[4]
    ]
    with (
        TestClient(create_app(settings)) as client,
        pytest.raises(RuntimeError, match="boom"),
    ):
        client.app.state.relay.service.submit = _raise(RuntimeError("boom"))  # type: ignore[attr-defined]
        client.post("/v1/runs", json={"command": ["true"]}, headers=auth)
