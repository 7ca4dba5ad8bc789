"""relay/client.py, copied alone into a temp folder and run with ``python -I -S`` (no
site-packages at all), against a live relay, a lossy proxy and a hostile server."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from testing.relay_server import RelayProcess
from tests.conftest import REPO

CANARY = "client-canary-5d1e"
FAIL_JOB = """
description = "Fail on purpose."
command = ["sh", "-c", "echo partial; echo oops >&2; exit 3"]
"""


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("client"), local_isolation="bwrap", max_wait_s=1, drain_s=1
    )
    (server.jobs_dir / "fail").mkdir()
    (server.jobs_dir / "fail" / "job.toml").write_text(FAIL_JOB)
    server.add_token("routine")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("routine")
    return Path(shutil.copy(REPO / "relay" / "client.py", folder / "client.py"))


def run_client(
    client_file: Path, *args: str, url: str, token: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": os.environ["PATH"], "RELAY_URL": url, **env}
    if token is not None:
        environment["RELAY_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-I", "-S", str(client_file), *args],
        cwd=client_file.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class Recorder:
    """A loopback HTTP server that records requests and answers with ``respond``."""

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler, bytes], None]) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.requests.append((self.command, dict(self.headers), body))
                respond(self, body)

            do_GET = do_POST = do_any

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
    handler.send_response(status)
    for name, value in {"Content-Length": str(len(body)), **headers}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.slow  # needs a relay process: seconds
def test_runs_a_job_with_nothing_but_the_standard_library(
    relay: RelayProcess, client_file: Path
) -> None:
    done = run_client(
        client_file, "echo", "-p", "message=from a routine", url=relay.url,
        token=relay.tokens["routine"],
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "from a routine\n", "")


@pytest.mark.slow  # needs a relay process: seconds
def test_exit_codes_follow_the_run(relay: RelayProcess, client_file: Path) -> None:
    token = relay.tokens["routine"]
    failed = run_client(client_file, "fail", url=relay.url, token=token)
    assert (failed.returncode, failed.stdout, failed.stderr) == (3, "partial\n", "oops\n")
    unknown = run_client(client_file, "nope", url=relay.url, token=token)
    assert unknown.returncode == 4  # not found
    assert unknown.stderr.startswith("error: no job named 'nope'; jobs here: ")
    refused = run_client(client_file, "echo", "-p", "message=x", url=relay.url, token="rly_bad")
    assert refused.returncode == 3 and refused.stderr.startswith("error: ")  # auth
    assert "HTTP 401" in refused.stderr and "unknown" not in refused.stderr
    for url in ("127.0.0.1:8080", "ftp://relay.example"):  # no scheme, or not HTTP
        bad_url = run_client(client_file, "echo", url=url, token=token)
        assert bad_url.returncode == 2
        assert bad_url.stderr == "error: RELAY_URL (or --url) must start with https:// or http://\n"
    no_token = run_client(client_file, "echo", url=relay.url)
    assert no_token.returncode == 2 and "RELAY_TOKEN" in no_token.stderr
    down = run_client(client_file, "echo", "--attempts", "1", url="http://127.0.0.1:9", token=token)
    assert down.returncode == 6 and down.stderr.startswith("error: cannot reach the relay")


@pytest.mark.slow  # needs a relay process: seconds
def test_waits_past_the_relays_hold_and_polls(relay: RelayProcess, client_file: Path) -> None:
    token = relay.tokens["routine"]
    # RELAY_MAX_WAIT_S is 1: the POST answers 202 and the client polls to the end.
    slept = run_client(client_file, "sleep", "-p", "seconds:=2", url=relay.url, token=token)
    assert (slept.returncode, slept.stdout) == (0, "sleeping\nwoke\n")
    accepted = run_client(
        client_file, "echo", "-p", "message=later", "--no-wait", url=relay.url, token=token
    )
    assert accepted.returncode == 0
    run_id = json.loads(accepted.stdout)["id"]
    waited = run_client(client_file, "--run", run_id, url=relay.url, token=token)
    assert (waited.returncode, waited.stdout) == (0, "later\n")


def forward(relay: RelayProcess, handler: BaseHTTPRequestHandler, body: bytes) -> tuple[int, bytes]:
    """Pass one request on to the relay; its status and body."""
    request = urllib.request.Request(  # noqa: S310 - loopback
        relay.url + handler.path,
        data=body if handler.command == "POST" else None,
        method=handler.command,
        headers={k: v for k, v in handler.headers.items() if k.lower() != "host"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as upstream:  # noqa: S310
            return upstream.status, upstream.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.slow  # needs a relay process: seconds
def test_a_failed_poll_is_polled_again(relay: RelayProcess, client_file: Path) -> None:
    failed_polls: list[str] = []

    def flaky(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        if handler.command == "GET" and not failed_polls:
            failed_polls.append(handler.path)
            answer(handler, 503, b"busy")
            return
        status, payload = forward(relay, handler, body)
        answer(handler, status, payload, **{"Content-Type": "application/json"})

    with Recorder(flaky) as proxy:
        done = run_client(
            client_file, "sleep", "-p", "seconds:=2", url=proxy.url, token=relay.tokens["routine"]
        )
    assert (done.returncode, done.stdout) == (0, "sleeping\nwoke\n"), done.stderr
    assert len(failed_polls) == 1


@pytest.mark.slow  # needs a relay process: seconds
def test_a_lost_answer_is_retried_with_the_same_key_and_runs_once(
    relay: RelayProcess, client_file: Path
) -> None:
    """The first POST reaches the relay, but its answer is lost on the way back (502)."""
    forwarded: list[int] = []

    def lossy(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        status, payload = forward(relay, handler, body)
        if handler.command == "POST" and not forwarded:
            forwarded.append(status)
            answer(handler, 502, b"<html>bad gateway</html>", **{"Retry-After": "0"})
            return
        answer(handler, status, payload, **{"Content-Type": "application/json"})

    token = relay.tokens["routine"]
    before = relay.get(token, "/v1/runs", job="echo", limit=200).json()["runs"]
    with Recorder(lossy) as proxy:
        done = run_client(client_file, "echo", "-p", "message=once", url=proxy.url, token=token)
    assert (done.returncode, done.stdout) == (0, "once\n"), done.stderr
    keys = {headers["Idempotency-Key"] for method, headers, _ in proxy.requests if method == "POST"}
    assert len([r for r in proxy.requests if r[0] == "POST"]) == 2 and len(keys) == 1
    after = relay.get(token, "/v1/runs", job="echo", limit=200).json()["runs"]
    assert len(after) == len(before) + 1  # one sandbox, not two


@pytest.mark.parametrize(
    ("status", "code"), [(401, "x"), (403, "x"), (407, "x"), (401, "token_expired")]
)
def test_an_auth_error_body_is_never_printed(client_file: Path, status: int, code: str) -> None:
    """Only a code the relay names for an auth failure is read from it (token_expired: what
    to do differs), never its message."""
    body = json.dumps({"error": {"code": code, "message": f"key {CANARY} refused"}}).encode()
    with Recorder(lambda h, _: answer(h, status, body)) as hostile:
        done = run_client(client_file, "echo", url=hostile.url, token="rly_x")
    assert done.returncode == 3 and done.stderr.startswith("error: ")
    assert CANARY not in done.stderr + done.stdout
    assert ("token_expired" in done.stderr) == (code == "token_expired"), done.stderr
    assert len(hostile.requests) == 1  # an auth error is not retried


def test_a_page_that_is_not_the_relay_is_never_printed(client_file: Path) -> None:
    page = f"<html>proxy says {CANARY}</html>".encode()
    with Recorder(lambda h, _: answer(h, 200, page)) as hostile:
        done = run_client(client_file, "echo", url=hostile.url, token="rly_x")
    assert done.returncode == 6 and CANARY not in done.stderr + done.stdout


def test_header_choices(client_file: Path) -> None:
    run = json.dumps({"id": "run_1", "state": "succeeded", "exit_code": 0, "stdout": ""})
    with Recorder(lambda h, _: answer(h, 200, run.encode())) as server:
        none = run_client(client_file, "echo", "--no-auth-header", url=server.url, token="t1")
        custom = run_client(
            client_file, "echo", url=server.url, token="t2", RELAY_AUTH_HEADER="X-Api-Key"
        )
        bearer = run_client(client_file, "echo", url=server.url, token="t3")
    assert none.returncode == custom.returncode == bearer.returncode == 0
    sent = [{k.lower(): v for k, v in headers.items()} for _, headers, _ in server.requests]
    assert "authorization" not in sent[0] and "x-api-key" not in sent[0]
    assert sent[1]["x-api-key"] == "t2" and "authorization" not in sent[1]
    assert sent[2]["authorization"] == "Bearer t3"


@pytest.mark.slow  # needs a relay process: seconds
def test_a_custom_auth_header_works_against_a_relay(tmp_path: Path, client_file: Path) -> None:
    server = RelayProcess(tmp_path / "x-api-key", local_isolation="bwrap", auth_header="X-Api-Key")
    token = server.add_token("routine")
    server.start()
    try:
        done = run_client(
            client_file, "echo", "-p", "message=raw", url=server.url, token=token,
            RELAY_AUTH_HEADER="X-Api-Key",
        )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "raw\n"), done.stderr
    finally:
        server.stop()


def relay_run(relay: RelayProcess, *args: str, stderr: int) -> subprocess.Popen[bytes]:
    env = {
        "PATH": os.environ["PATH"],
        "RELAY_URL": relay.url,
        "RELAY_TOKEN": relay.tokens["routine"],
    }
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "run", *args],
        cwd=relay.root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )


@pytest.mark.slow  # needs a relay process: seconds
def test_relay_run_spins_on_a_terminal_and_is_quiet_when_piped(relay: RelayProcess) -> None:
    """The spinner runs until the first output, which is then printed as it comes."""
    (relay.root / "late.py").write_text("import time\ntime.sleep(1)\nprint('sleeping')\n")
    primary, secondary = pty.openpty()
    process = relay_run(relay, "python", "--stdin", "late.py", stderr=secondary)
    os.close(secondary)
    seen = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0 and out == b"sleeping\n"
    assert b"\r| python " in seen and b"s" in seen.split(b"python")[-1]
    assert b"\x1b[K" in seen  # the spinner clears its line when done
    piped = relay_run(relay, "sleep", "-p", "seconds:=1", stderr=subprocess.PIPE)
    out, err = piped.communicate(timeout=30)
    assert (piped.returncode, out, err) == (0, b"sleeping\nwoke\n", b"")
