"""``/mcp`` sessions are bounded per token value: one token opening session after session
(each lives 30 minutes idle) cannot use up the relay's room and lock every other token out,
and a rotated or revoked value's sessions end when the token file reloads, so the new value
has room at once. A web page elsewhere (DNS rebinding: its name pointed at the relay) gets no
session at all: its browser's ``Origin`` is refused before the token is read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from relay.auth import TokenStore, revoke_token, rotate_token
from relay.errors import Forbidden
from relay.http.mcp_sessions import MAX_SESSIONS_PER_TOKEN, check_origin, own_origins
from relay.settings import Settings
from testing.relay_server import RelayProcess

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
    server = RelayProcess(
        tmp_path_factory.mktemp("relay"), mcp_allowed_origins="http://localhost:6274"
    )
    server.add_token("greedy", jobs=["echo"])
    server.add_token("other", jobs=["echo"])
    server.start()
    yield server
    server.stop()


@pytest.mark.slow  # needs a relay process: seconds
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


@pytest.mark.slow  # needs a relay process: seconds
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


def open_session(
    client: httpx.Client, relay: RelayProcess, token: str, **headers: str
) -> httpx.Response:
    return client.post("/mcp", json=INITIALIZE, headers=relay.headers(token, **ACCEPT, **headers))


def run_states(relay: RelayProcess, admin: str, token: str) -> list[str]:
    """The states of ``token``'s sleep runs, as an admin token reads them."""
    answer = httpx.get(
        relay.url + "/v1/runs",
        params={"job": "sleep", "token": token},
        headers=relay.headers(admin),
        timeout=10,
    )
    runs: list[dict[str, Any]] = answer.json()["runs"]
    return [run["state"] for run in runs]


def wait_for_states(relay: RelayProcess, admin: str, token: str, states: list[str]) -> None:
    for _ in range(100):
        if run_states(relay, admin, token) == states:
            return
        time.sleep(0.1)
    assert run_states(relay, admin, token) == states


@pytest.mark.slow  # needs a relay process: seconds
def test_a_rotated_tokens_new_value_has_room_at_once(relay: RelayProcess) -> None:
    """The old value (leaked, say) holds every session it may; after `relay tokens rotate`,
    the new value opens one at once: sessions count by value, and the old value's are closed
    when the token file reloads."""
    old = relay.add_token("leaked", jobs=["echo"])
    with httpx.Client(base_url=relay.url, timeout=10) as client:
        for _ in range(MAX_SESSIONS_PER_TOKEN):
            assert open_session(client, relay, old).status_code == 200
        assert open_session(client, relay, old).status_code == 429
        new = rotate_token(relay.tokens_file, "leaked")
        opened = open_session(client, relay, new)
        assert opened.status_code == 200, opened.text
        for _ in range(MAX_SESSIONS_PER_TOKEN - 1):  # the whole room, not one session
            assert open_session(client, relay, new).status_code == 200
        assert open_session(client, relay, new).status_code == 429


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize("change", ["rotate", "revoke"])
def test_a_rotated_or_revoked_values_sessions_are_closed_with_their_calls(
    relay: RelayProcess, change: str
) -> None:
    """A call in flight in a session of the old value ends when the token file reloads (here:
    at the next request of any token): its run is canceled, not left to run out its time."""
    name = f"closing-{change}"
    old = relay.add_token(name, jobs=["echo", "sleep"])
    admin = relay.add_token(f"reader-{change}", jobs=["echo"], admin=True)
    with httpx.Client(base_url=relay.url, timeout=30) as client:
        opened = open_session(client, relay, old)
        assert opened.status_code == 200
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"]}
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        client.post("/mcp", json=initialized, headers=relay.headers(old, **ACCEPT, **session))
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "sleep", "arguments": {"seconds": 366}},
        }

        def calling() -> None:
            with httpx.Client(base_url=relay.url, timeout=60) as caller:
                caller.post("/mcp", json=call, headers=relay.headers(old, **ACCEPT, **session))

        thread = threading.Thread(target=calling)
        thread.start()
        try:
            wait_for_states(relay, admin, name, ["running"])
            if change == "rotate":
                rotate_token(relay.tokens_file, name)
            else:
                revoke_token(relay.tokens_file, name)
            relay.get(admin, "/v1/jobs")  # any request reloads the changed file
            wait_for_states(relay, admin, name, ["canceled"])
        finally:
            thread.join(30)
        assert not thread.is_alive()  # the call's stream ended with its session
        gone = client.post(
            "/mcp",
            json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"},
            headers=relay.headers(admin, **ACCEPT, **session),
        )
        assert gone.status_code == 404


INITIALIZE_FROM_A_PAGE = {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"}


@pytest.mark.slow  # needs a relay process: seconds
def test_a_page_elsewhere_gets_no_session(relay: RelayProcess) -> None:
    """DNS rebinding: a page of evil.example, its name now pointing at the relay, posts from
    the user's browser; the Origin is not the relay's, so no session (whatever the token)."""
    token = relay.tokens["other"]
    with httpx.Client(base_url=relay.url, timeout=10) as client:
        for origin in ("http://evil.example:8080", "null", "http://127.0.0.1:1", "x" * 5000):
            headers = {**INITIALIZE_FROM_A_PAGE, "Origin": origin}
            for presented in (token, None):
                refused = open_session(client, relay, presented, **headers)  # type: ignore[arg-type]
                assert refused.status_code == 403, refused.text
                error = refused.json()["error"]
                assert error["code"] == "forbidden"
                assert "RELAY_MCP_ALLOWED_ORIGINS" in error["message"]
                assert "mcp-session-id" not in refused.headers
                assert origin not in refused.text
        # Every method, not only the opening POST.
        opened = open_session(client, relay, token)
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"]}
        for method in ("GET", "DELETE"):
            refused = client.request(
                method,
                "/mcp",
                headers=relay.headers(token, **ACCEPT, **session, **INITIALIZE_FROM_A_PAGE),
            )
            assert refused.status_code == 403
        # No Origin (a server-side client), the relay's own, and an allowed page's: sessions.
        for headers in (
            {"Host": "evil.example:8080"},
            {"Origin": f"http://localhost:{relay.port}"},
            {"Origin": f"http://127.0.0.1:{relay.port}"},
            {"Origin": "http://LOCALHOST:6274"},
        ):
            assert open_session(client, relay, token, **headers).status_code == 200, headers


def test_the_relays_own_origin_is_its_public_url_else_its_loopback_port() -> None:
    public = Settings(
        public_url="https://Relay.Example.com/", mcp_allowed_origins="http://a.test:3000"
    )
    assert own_origins(public) == {"https://relay.example.com", "http://a.test:3000"}
    check_origin("https://relay.example.com:443", own_origins(public))
    check_origin(None, own_origins(public))
    for foreign in (
        "http://relay.example.com",
        "https://relay.example.com.evil.test",
        "http://127.0.0.1:8080",
    ):
        with pytest.raises(Forbidden):
            check_origin(foreign, own_origins(public))
    assert own_origins(Settings(port=9000)) == {
        "http://127.0.0.1:9000",
        "http://localhost:9000",
        "http://[::1]:9000",
    }
    with pytest.raises(ValueError, match="not an origin"):
        Settings(mcp_allowed_origins="https://a.test/app")
    with pytest.raises(ValueError, match="http"):
        Settings(public_url="relay.example.com")


@pytest.mark.slow  # needs a relay process: seconds
def test_an_old_values_sessions_live_through_the_overlap_and_close_at_its_end_unasked(
    relay: RelayProcess,
) -> None:
    """`relay tokens rotate --overlap`: the old value's session (and its call) goes on while
    the old value is valid, and is closed when the overlap ends, with no request to make
    the relay look: its run is canceled at that moment, not at the next request."""
    name = "overlapped"
    old = relay.add_token(name, jobs=["echo", "sleep"])
    admin = relay.add_token("reader-overlap", jobs=["echo"], admin=True)
    with httpx.Client(base_url=relay.url, timeout=30) as client:
        opened = open_session(client, relay, old)
        assert opened.status_code == 200
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"]}
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        client.post("/mcp", json=initialized, headers=relay.headers(old, **ACCEPT, **session))
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "sleep", "arguments": {"seconds": 366}},
        }

        def calling() -> None:
            with httpx.Client(base_url=relay.url, timeout=60) as caller:
                caller.post("/mcp", json=call, headers=relay.headers(old, **ACCEPT, **session))

        thread = threading.Thread(target=calling)
        thread.start()
        try:
            wait_for_states(relay, admin, name, ["running"])
            overlap_s = 2.0
            new = rotate_token(relay.tokens_file, name, overlap_s=overlap_s)
            (ends,) = [
                p.previous_until for p in TokenStore(relay.tokens_file).principals if p.name == name
            ]
            assert ends is not None
            listing = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
            still = client.post(
                "/mcp", json=listing, headers=relay.headers(old, **ACCEPT, **session)
            )
            assert still.status_code == 200  # read the changed file: the old value is valid
            assert open_session(client, relay, new).status_code == 200
            time.sleep(max(0.0, ends - time.time()) + 2.0)  # no request meanwhile
            found = httpx.get(
                relay.url + "/v1/runs",
                params={"job": "sleep", "token": name},
                headers=relay.headers(admin),
                timeout=10,
            )
            answer = found.json()["runs"]
        finally:
            thread.join(30)
        assert [run["state"] for run in answer] == ["canceled"]
        ended = datetime.fromisoformat(answer[0]["ended_at"]).timestamp()
        assert ended < ends + 1.5, ended - ends  # closed at the end, not by the last request
        expired = client.post("/mcp", json=listing, headers=relay.headers(old, **ACCEPT))
        assert expired.status_code == 401
        assert expired.json()["error"]["code"] == "token_expired"
