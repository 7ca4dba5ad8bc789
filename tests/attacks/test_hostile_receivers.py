"""Webhook receivers that answer to hold the relay: a body that never ends, headers one
byte at a time. An attempt is bounded by ``RELAY_WEBHOOK_TIMEOUT_S`` in all, and the relay
reads the status alone, never the receiver's body."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testing.relay_server import RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds

TIMEOUT_S = 1.5
DRIP_S = 0.2
HOLD_S = 15.0
"""How long a hostile receiver keeps dripping at most (the test ends before)."""


class Dripper:
    """A loopback server that answers every connection with ``head`` and then one byte
    every :data:`DRIP_S`, until the relay hangs up (or :data:`HOLD_S` passed)."""

    def __init__(self, head: bytes, drip_head: bool = False) -> None:
        self.head, self.drip_head = head, drip_head
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.hung_up = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        end = time.monotonic() + HOLD_S
        with connection:
            connection.settimeout(DRIP_S)
            try:
                connection.recv(65536)  # the request (small: one run)
                if not self.drip_head:
                    connection.sendall(self.head)
                sent = 0
                while time.monotonic() < end:
                    piece = self.head[sent : sent + 1] if self.drip_head else b"x"
                    connection.sendall(piece or b"x")
                    sent += 1
                    time.sleep(DRIP_S)
            except OSError:
                self.hung_up.set()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("hostile-receivers"),
        local_isolation="bwrap",
        webhook_allow_http="true",
        webhook_allow_private="true",
        webhook_timeout_s=TIMEOUT_S,
        webhook_backoff_s=30,
        webhook_max_attempts=2,
        webhook_secret="whsec-hostile-receivers-1",
    )
    server.add_token("hooks", jobs=["echo"])
    server.start()
    yield server
    server.stop()


def _first_attempt(relay: RelayProcess, url: str) -> tuple[dict[str, Any], float]:
    body = {"job": "echo", "params": {"message": "hi"}, "callback_url": url}
    run = relay.post(relay.tokens["hooks"], body).json()
    assert run["state"] == "succeeded", run
    started = time.monotonic()
    deadline = started + TIMEOUT_S + 8
    while time.monotonic() < deadline:
        found = relay.get(relay.tokens["hooks"], f"/v1/runs/{run['id']}").json()["deliveries"]
        if found and found[0]["attempts"]:
            return found[0]["attempts"][0], time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError("the first attempt was never recorded: the relay is still reading")


def test_a_body_that_never_ends_is_not_read(relay: RelayProcess) -> None:
    """The relay read the whole body (into memory, as long as it came): a receiver that
    kept sending held the attempt, and its slot, for ever."""
    dripper = Dripper(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
    try:
        attempt, seconds = _first_attempt(relay, f"http://127.0.0.1:{dripper.port}/hook")
        assert attempt.get("status_code") == 200, attempt
        assert seconds < TIMEOUT_S + 3
        assert dripper.hung_up.wait(5), "the relay kept the connection open"
    finally:
        dripper.close()


def test_headers_one_byte_at_a_time_time_out(relay: RelayProcess) -> None:
    """Each byte came within the read timeout, so no timeout ever fired."""
    head = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 400 + b"\r\n\r\n"
    dripper = Dripper(head, drip_head=True)
    try:
        attempt, seconds = _first_attempt(relay, f"http://127.0.0.1:{dripper.port}/hook")
        assert attempt.get("error") == "timeout", attempt
        assert seconds < TIMEOUT_S + 3
    finally:
        dripper.close()
