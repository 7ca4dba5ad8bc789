"""``/mcp``'s SDK is imported by the first request to it, not by every start (issue 42):
a relay that nobody calls over MCP never pays its ~0.5 s of CPU, and one that is called
answers as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from relay.auth import new_token
from relay.http.app import create_app
from tests.conftest import REPO, make_settings

SCRIPT = """
import sys
from pathlib import Path
from starlette.testclient import TestClient
from relay.auth import new_token
from relay.http.app import create_app
from testing.settings import make_settings

settings = make_settings(Path(sys.argv[1]), providers=["memory"])
token = new_token(settings.tokens_file, "ops")
SDK = ("mcp", "mcp_types")
with TestClient(create_app(settings)) as client:
    assert client.get("/healthz").status_code == 200
    print("started:", sorted(name for name in SDK if name in sys.modules))
    answer = client.post(
        "/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}},
        headers={"Authorization": f"Bearer {token}",
                 "Accept": "application/json, text/event-stream"},
    )
    print("called:", answer.status_code, sorted(name for name in SDK if name in sys.modules))
    print("session:", bool(answer.headers.get("mcp-session-id")))
"""


@pytest.mark.slow  # starts a relay process: seconds
def test_a_relay_starts_without_the_mcp_sdk_and_imports_it_at_the_first_mcp_request(
    tmp_path: Path,
) -> None:
    # A fresh interpreter: the test's own process has imported the SDK long ago.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "started: []" in lines
    assert "called: 200 ['mcp', 'mcp_types']" in lines
    assert "session: True" in lines


def test_an_mcp_sdk_that_fails_to_load_fails_mcp_alone_and_the_relay_serves_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str) -> None:
        raise ImportError(f"no module named {name!r}")

    monkeypatch.setattr("relay.http.mcp_loader.importlib", SimpleNamespace(import_module=broken))
    settings = make_settings(tmp_path, providers=["memory"])
    token = new_token(settings.tokens_file, "ops")
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answer = client.post(
            "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers
        )
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal"
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/jobs", headers=headers).status_code == 200
    assert "the MCP endpoint failed to load" in caplog.text
