"""A webhook receiver on a loopback port: records every POST, answers from a script."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    """``statuses`` are answered in turn (the last one repeats); default: always 200.
    ``delay_s`` holds each answer that long (a receiver too slow for the relay)."""

    def __init__(self, statuses: list[int] | None = None, delay_s: float = 0.0) -> None:
        self.statuses = list(statuses or [200])
        self.delay_s = delay_s
        self.received: list[Received] = []
        self._lock = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, dict(self.headers.items()), body, time.time())
                    )
                    index = min(len(receiver.received), len(receiver.statuses)) - 1
                    status = receiver.statuses[index]
                    receiver._lock.notify_all()
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the relay gave up waiting (a timeout test) and hung up

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def for_run(self, run_id: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.headers.get("Relay-Run-Id") == run_id]

    def wait_for(self, run_id: str, count: int = 1, timeout_s: float = 30) -> list[Received]:
        """Block until ``count`` POSTs for this run have arrived; returns them."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self.for_run_locked(run_id)) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"{len(self.for_run_locked(run_id))} of {count} deliveries for {run_id}"
                    )
                self._lock.wait(remaining)
            return self.for_run_locked(run_id)

    def for_run_locked(self, run_id: str) -> list[Received]:
        return [r for r in self.received if r.headers.get("Relay-Run-Id") == run_id]
