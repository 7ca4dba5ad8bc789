"""``/mcp`` sessions are bounded per token: one token opening session after session (each
lives 30 minutes idle) cannot use up the relay's room and lock every other token out."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from relay.auth import rotate_token
from relay.http.mcp_server import MAX_SESSIONS_PER_TOKEN
from tests.relay_server import RelayProcess

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream"}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("relay"))
    server.add_token("greedy", jobs=["echo"])
    server.add_token("other", jobs=["echo"])
    server.start()
    yield server
    server.stop()


def test_one_token_cannot_hold_every_mcp_session(relay: RelayProcess) -> None:
    with httpx.Client(base_url=relay.url, timeout=10) as client:

        def open_session(token: str) -> httpx.Response:
            return client.post("/mcp", json=INITIALIZE, headers=relay.headers(token, **ACCEPT))

        greedy = relay.tokens["greedy"]
        sessions = []
        for _ in range(MAX_SESSIONS_PER_TOKEN):
            answer = open_session(greedy)
            assert answer.status_code == 200
            sessions.append(answer.headers["mcp-session-id"])
        refused = open_session(greedy)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert "mcp-session-id" not in refused.headers
        assert open_session(relay.tokens["other"]).status_code == 200
        # A session the client ends makes room again.
        ended = client.delete(
            "/mcp", headers=relay.headers(greedy, **ACCEPT, **{"Mcp-Session-Id": sessions[0]})
        )
        assert ended.status_code == 200
        assert open_session(greedy).status_code == 200


def test_a_rotated_token_does_not_inherit_the_old_values_sessions(relay: RelayProcess) -> None:
    """Rotating a leaked token cuts off what its old value opened: the new value, same name,
    is not the session's owner."""
    relay.add_token("rotated", jobs=["echo"])
    with httpx.Client(base_url=relay.url, timeout=10) as client:
        old = relay.tokens["rotated"]
        opened = client.post("/mcp", json=INITIALIZE, headers=relay.headers(old, **ACCEPT))
        assert opened.status_code == 200
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"]}
        new = rotate_token(relay.tokens_file, "rotated")
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        answer = client.post("/mcp", json=listing, headers=relay.headers(new, **ACCEPT, **session))
        assert answer.status_code == 404
        assert (
            client.post(
                "/mcp", json=listing, headers=relay.headers(old, **ACCEPT, **session)
            ).status_code
            == 401
        )  # the old value is no token any more
