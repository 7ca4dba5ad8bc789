"""Serve the fake on 127.0.0.1 in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from tests.fakes.daytona.app import build_app
from tests.fakes.daytona.world import Faults, Ledger, World


@dataclass
class FakeDaytona:
    """A running fake: ``api_url`` for the SDK, its ground truth and fault switches."""

    url: str
    world: World
    loop: asyncio.AbstractEventLoop

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def ledger(self) -> Ledger:
        return self.world.ledger

    @property
    def faults(self) -> Faults:
        return self.world.faults

    def reset(self) -> None:
        """Clear every fault (and release a hanging create)."""
        self.world.faults.reset()
        self.loop.call_soon_threadsafe(self._release_hang)

    def _release_hang(self) -> None:
        self.world.hang.set()
        self.world.hang = asyncio.Event()

    def call(self, function_name: str, *args: object) -> None:
        """Run a World method (``vanish``, ``stop``, ``delete``) on the fake's loop."""
        done = threading.Event()

        def run() -> None:
            try:
                getattr(self.world, function_name)(*args)
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait(5)


@contextmanager
def running_fake(port: int = 0) -> Iterator[FakeDaytona]:
    """Serve a fresh fake; on exit kill every process it started and stop serving."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def serve() -> None:
        world = World()
        holder["world"] = world
        config = uvicorn.Config(
            build_app(world, url),
            log_level="warning",
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="wsproto",
            http="h11",
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        holder["server"] = server
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        ready.set()
        await task
        await world.shutdown()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=main, name="fake-daytona", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fake Daytona server did not start")
    world = holder["world"]
    assert isinstance(world, World)
    fake = FakeDaytona(url=url, world=world, loop=loop)
    try:
        yield fake
    finally:
        server = holder["server"]
        assert isinstance(server, uvicorn.Server)
        # Kill every process first, so open log streams end and shutdown is quick.
        asyncio.run_coroutine_threadsafe(world.shutdown(), loop).result(15)
        server.should_exit = True
        thread.join(15)
        sock.close()
