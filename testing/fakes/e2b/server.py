"""Serve the fake E2B (control plane + envd on one URL) with uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette

from testing.fakes.e2b import control
from testing.fakes.e2b.envd import Envd
from testing.fakes.e2b.world import Faults, Ledger, World


def create_app(world: World) -> Starlette:
    return Starlette(routes=[*control.routes(world), *Envd(world).routes()])


class FakeE2B:
    """A running fake: ``url`` for both ``e2b_api_url`` and ``e2b_sandbox_url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.world = World()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-e2b", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults

    def reset(self) -> None:
        self.world.faults.reset()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError("the fake E2B did not start") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = uvicorn.Config(
            create_app(self.world),
            log_level="warning",
            log_config=None,  # no handlers of its own: tests capture it, injected faults stay quiet
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[self._sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        await self._stop.wait()
        # Kill every sandbox first: that ends open command streams, so the server
        # can shut down at once and no subprocess outlives the fake.
        await self.world.shutdown()
        server.should_exit = True
        await serving
        self._sock.close()


@contextmanager
def running_fake(host: str = "127.0.0.1", port: int = 0) -> Iterator[FakeE2B]:
    """Serve a fresh fake on a free loopback port for the duration of the block."""
    fake = FakeE2B(host, port)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()
