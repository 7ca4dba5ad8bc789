"""The admin side's query parameters with odd values: a 4xx JSON error or an answer,
never ``500 internal``, for admin and plain tokens alike."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import pytest

from testing.relay_server import RelayProcess
from tests.conftest import new_database

pytestmark = pytest.mark.slow  # needs a relay process: seconds

ODD = ["²", "\u0661\u0660", "-1", "1e3", " 7", "7\u00a0", "0x10", "9" * 400, "\x00", "%", "", "nan"]
"""Digits only Python calls digits, numbers in other notations, control bytes, nothing."""
MOMENTS = ["0001-01-01", "9999-12-31T23:59:59-23:59", "2026-13-01", "²⁰²⁶-01-01", "T", "\x00"]


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def relay(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayProcess]:
    """A relay on each engine: PostgreSQL refuses some text SQLite takes (a NUL)."""
    settings: dict[str, str] = {}
    if request.param == "postgres":
        server_url = request.getfixturevalue("postgres_url")
        settings["database_url"] = asyncio.run(new_database(server_url))
    server = RelayProcess(tmp_path_factory.mktemp("relay"), **settings)
    server.add_token("boss", admin=True)
    server.add_token("plain")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("name", ["boss", "plain"])
def test_odd_filters_are_refused_not_internal(relay: RelayProcess, name: str) -> None:
    token = relay.tokens[name]
    asked = [("/v1/spend", {"days": value}) for value in ODD]
    asked += [("/v1/outcomes", {"hours": value}) for value in ODD]
    asked += [("/v1/runs", {"limit": value}) for value in ODD]
    asked += [("/v1/runs", {key: value}) for key in ("since", "until") for value in MOMENTS]
    asked += [
        ("/v1/runs", {key: value})
        for key in ("token", "provider", "job", "cursor", "state", "q")
        for value in ["\x00", "ß" * 300, "'", "%", "\\", "_", "run_", ",", "failed,,lost", "\ud7ff"]
    ]
    crafted = base64.urlsafe_b64encode(b"1.0|run_\x00").decode()  # a cursor not given out
    asked.append(("/v1/runs", {"cursor": crafted}))
    for path, query in asked:
        answer = httpx.get(relay.url + path, headers=relay.headers(token), params=query, timeout=30)
        assert answer.status_code < 500, (path, query, answer.text)
        odd_text = any("\x00" in value for value in query.values())
        if path == "/v1/runs" and (odd_text or query.get("cursor") == crafted):
            assert answer.status_code == 400, (path, query, answer.text)  # not a store error
        assert answer.headers["content-type"].startswith("application/json")
