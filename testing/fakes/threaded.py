"""Serve a fake provider's Starlette app on 127.0.0.1 in a background thread with its own
event loop: the Vercel, Sprites and Daytona fakes share it (their worlds differ, not this).

A fake's world has ``faults`` (with ``reset()``), a ``ledger``, a ``hang`` event a hanging
create waits on, and ``shutdown()``, which kills every process it started.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import uvicorn
from starlette.types import ASGIApp


class World(Protocol):
    faults: Any
    ledger: Any
    hang: asyncio.Event

    async def shutdown(self) -> None: ...


W = TypeVar("W", bound=World)


@dataclass
class RunningFake(Generic[W]):
    """A running fake: its URL, ground truth (``ledger``) and fault switches."""

    url: str
    world: W
    loop: asyncio.AbstractEventLoop

    @property
    def ledger(self) -> Any:
        return self.world.ledger

    @property
    def faults(self) -> Any:
        return self.world.faults

    def reset(self) -> None:
        """Clear every fault (and release a hanging create)."""
        self.world.faults.reset()
        self.loop.call_soon_threadsafe(self._release_hang)

    def _release_hang(self) -> None:
        self.world.hang.set()
        self.world.hang = asyncio.Event()

    def call(self, function_name: str, *args: object) -> None:
        """Run a world method (``vanish``, ``stop``, ``delete`` …) on the fake's loop."""
        done = threading.Event()

        def run() -> None:
            try:
                getattr(self.world, function_name)(*args)
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait(5)


@contextmanager
def serving(
    label: str,
    make_world: Callable[[], W],
    build_app: Callable[[W, str], ASGIApp],
    port: int = 0,
    ws: Literal["none", "wsproto"] = "none",
) -> Iterator[tuple[str, W, asyncio.AbstractEventLoop]]:
    """Serve a fresh world's app; on exit kill every process it started and stop serving."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        world = make_world()  # inside the loop: its events belong to it
        holder["world"] = world
        config = uvicorn.Config(
            build_app(world, url),
            log_level="warning",
            log_config=None,
            access_log=False,
            lifespan="off",
            ws=ws,
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

    thread = threading.Thread(target=main, name=f"fake-{label.lower()}", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError(f"the fake {label} server did not start")
    world: W = holder["world"]
    try:
        yield url, world, loop
    finally:
        server: uvicorn.Server = holder["server"]
        # Kill every process first, so open output streams end and shutdown is quick.
        asyncio.run_coroutine_threadsafe(world.shutdown(), loop).result(15)
        server.should_exit = True
        thread.join(15)
        sock.close()
