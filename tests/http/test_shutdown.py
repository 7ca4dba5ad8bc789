"""SIGTERM as README's Reliability section says: a real ``relay serve``, real signals.

The relay keeps its listener for the drain: a new run answers ``503 shutting_down`` with
``Retry-After``, a held ``wait: true`` caller gets its run as JSON (finished, or canceled
with ``shutting_down``), then the process exits 0.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds

DRAIN_S = 3
MARGIN_S = 5  # the answers going out, the store closing, the interpreter exiting


def _running(server: RelayProcess, token: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        runs = server.get(token, "/v1/runs", state="running").json()["runs"]
        if len(runs) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} runs did not start:\n{server.log()}")


def test_sigterm_keeps_serving_through_the_drain(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "s", drain_s=DRAIN_S)
    token = server.add_token("t", command=True)
    server.start()
    assert server.process is not None
    try:
        with ThreadPoolExecutor(2) as pool:
            held: Future[httpx.Response] = pool.submit(
                server.post, token, {"command": ["sleep", "60"], "wait": True}
            )
            quick: Future[httpx.Response] = pool.submit(
                server.post, token, {"command": ["sh", "-c", "sleep 1; echo done"], "wait": True}
            )
            _running(server, token, 2)
            server.process.send_signal(signal.SIGTERM)
            signaled = time.monotonic()
            time.sleep(0.2)

            refused = server.post(token, {"command": ["echo", "late"]}, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert int(refused.headers["Retry-After"]) >= 1

            finished = quick.result(timeout=DRAIN_S + MARGIN_S)
            assert finished.headers["content-type"] == "application/json"
            assert finished.json()["state"] == "succeeded"
            assert finished.json()["stdout"] == "done\n"

            cut = held.result(timeout=DRAIN_S + MARGIN_S)
            assert cut.headers["content-type"] == "application/json", cut.text
            assert cut.json()["state"] == "canceled"
            assert cut.json()["error"]["code"] == "shutting_down"
            assert time.monotonic() - signaled >= DRAIN_S - 0.5  # held until the drain ended

        assert server.process.wait(DRAIN_S + MARGIN_S) == 0, server.log()
        assert time.monotonic() - signaled < DRAIN_S + MARGIN_S
    finally:
        server.kill()


def test_sigterm_with_nothing_running_exits_at_once(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "q", drain_s=30)
    server.add_token("t", command=True)
    server.start()
    assert server.process is not None
    try:
        signaled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(MARGIN_S) == 0, server.log()
        assert time.monotonic() - signaled < MARGIN_S
    finally:
        server.kill()
