"""The relay's own URL in answers (a run's Location): as the caller reached it, or
RELAY_PUBLIC_URL; remembered per way of reaching it, never across them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request

from relay.http.app_state import MAX_BASE_URLS, AppState
from tests.conftest import make_settings


def request(host: str, scheme: str = "http", root_path: str = "") -> Request:
    return Request(
        {
            "type": "http",
            "method": "POST",
            "scheme": scheme,
            "server": ["127.0.0.1", 8080],  # as some servers give it: a list
            "root_path": root_path,
            "path": "/v1/runs",
            "query_string": b"",
            "headers": [(b"host", host.encode())],
        }
    )


def app_state(tmp_path: Path, **settings: Any) -> AppState:
    nothing: Any = None
    return AppState(make_settings(tmp_path, **settings), nothing, nothing, nothing, {}, nothing)


def test_each_host_and_scheme_gets_its_own_url_and_the_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    state = app_state(tmp_path)
    for _round in range(2):  # the second round is answered from what the first remembered
        for number in range(MAX_BASE_URLS + 20):
            host = f"relay-{number}.example.com"
            assert state.base_url(request(host)) == f"http://{host}"
            assert state.base_url(request(host, "https")) == f"https://{host}"
        assert state.base_url(request("a.example", root_path="/relay")) == "http://a.example/relay"
        assert len(state._base_urls) == MAX_BASE_URLS  # a caller's Host headers can't grow it


def test_the_public_url_wins(tmp_path: Path) -> None:
    state = app_state(tmp_path, public_url="https://relay.example.com/")
    assert state.base_url(request("evil.example")) == "https://relay.example.com"


def test_a_caller_sending_many_hosts_cannot_keep_the_usual_one_out(tmp_path: Path) -> None:
    """Past MAX_BASE_URLS the cache took nothing more: the first 64 Hosts a token holder
    sent (any bytes) kept the relay's usual Host out for good, built on every answer. The
    oldest is forgotten instead, and an overlong Host is never remembered."""
    state = app_state(tmp_path)
    for number in range(MAX_BASE_URLS + 20):
        state.base_url(request(f"junk-{number}"))
    assert state.base_url(request("relay.example.com")) == "http://relay.example.com"
    assert "relay.example.com" in {key[-1] for key in state._base_urls}
    long_host = "a" * 10_000
    assert state.base_url(request(long_host)) == f"http://{long_host}"
    assert long_host not in {key[-1] for key in state._base_urls}
    assert len(state._base_urls) == MAX_BASE_URLS
