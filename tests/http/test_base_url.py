"""The relay's own URL in answers (a run's Location): RELAY_PUBLIC_URL, else relative under
the server's root path; never the caller's Host (issue 34)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request

from relay.http.app_state import AppState
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


def test_without_a_public_url_the_url_is_relative_whatever_the_host(tmp_path: Path) -> None:
    state = app_state(tmp_path)
    for host in ("evil.example.com", "relay.example.com", "a" * 10_000, ""):
        assert state.base_url(request(host)) == ""
        assert state.base_url(request(host, "https")) == ""
    assert state.base_url(request("evil.example.com", root_path="/relay/")) == "/relay"


def test_the_public_url_wins(tmp_path: Path) -> None:
    state = app_state(tmp_path, public_url="https://relay.example.com/")
    assert state.base_url(request("evil.example")) == "https://relay.example.com"
