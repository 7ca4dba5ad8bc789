"""``POST /v1/runs`` is served by the relay's request middleware, not Starlette's router
(relay/http/app.py): its errors must answer as every routed request's do."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

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
