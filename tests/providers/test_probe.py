"""``relay probe``: one dated line with the timings; exit 0 when the provider works, 2 and
``error: …`` when it does not, without a word of what the provider answered."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from relay.providers.probe import run_probe

CANARY = "probe-canary-c4f2"
LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ probe (?P<provider>\S+) (?P<verdict>ok|failed at \w+)"
    r"(?P<timings>( (create|exec|terminate)=\d+ms)*)( sandbox=\S+)?"
    r"(( \w+=\S+)* limits=(?P<limits>\S+))?$"
)


def probe(provider: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", "probe", provider],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_local_probe_prints_one_dated_line_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    done = probe("local", tmp_path, RELAY_LOCAL_ISOLATION="bwrap", RELAY_LOCAL_ROOT=str(root))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    [line] = done.stdout.splitlines()
    match = LINE.match(line)
    assert match and match["provider"] == "local" and match["verdict"] == "ok", line
    assert {"create", "exec", "terminate"} == set(re.findall(r"(\w+)=\d+ms", line))
    assert "disk" in match["limits"].split(",")  # the limits in force are shown
    assert list(root.iterdir()) == []  # the sandbox is gone


def test_unknown_or_unconfigured_provider_exits_2(tmp_path: Path) -> None:
    unknown = probe("nope", tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: ")
    unset = probe("vercel", tmp_path)
    assert unset.returncode == 2 and "RELAY_VERCEL_TOKEN" in unset.stderr
    assert "Traceback" not in unknown.stderr + unset.stderr


@pytest.fixture
def hostile() -> Iterator[str]:
    """A provider API that refuses everything, quoting the key it was sent."""

    class Handler(BaseHTTPRequestHandler):
        def do_any(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            quoted = f"{CANARY} {self.headers.get('Authorization')}"
            body = json.dumps({"error": {"code": "forbidden", "message": quoted}}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_any

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_refusing_provider_fails_at_create_without_echoing_it(
    tmp_path: Path, hostile: str
) -> None:
    key = f"key-{CANARY}"
    done = probe(
        "vercel",
        tmp_path,
        RELAY_VERCEL_TOKEN=key,
        RELAY_VERCEL_TEAM_ID="team_x",
        RELAY_VERCEL_PROJECT_ID="prj_x",
        RELAY_VERCEL_BASE_URL=hostile,
        RELAY_CREATE_TIMEOUT_S="5",
    )
    assert done.returncode == 2
    [line] = done.stdout.splitlines()
    match = LINE.match(line)
    assert match and match["verdict"] == "failed at create", line
    assert done.stderr.splitlines()[-1].startswith("error: provider_auth: ")
    assert CANARY not in done.stdout + done.stderr


@pytest.mark.parametrize("provider", ["e2b", "modal", "vercel", "sprites", "daytona"])
async def test_cloud_probe_through_the_real_sdk_leaves_nothing_alive(provider: str) -> None:
    """Each cloud provider, through its real SDK, against its protocol fake."""
    harness = importlib.import_module(f"tests.contract.test_{provider}")
    with harness.running_fake() as fake:
        result = await run_probe(provider, harness.settings_for(fake))
        assert result.ok, result.error
        assert set(result.timings_ms) == {"create", "exec", "terminate"}
        assert LINE.match(result.line()), result.line()
        assert fake.ledger.alive() == set()
