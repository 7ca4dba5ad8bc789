"""Run the fake Modal (control plane + command router on one port) in a background thread."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from grpclib.server import Server
from modal_proto import api_pb2

from testing.fakes.modal.control import ControlPlane
from testing.fakes.modal.router import Router
from testing.fakes.modal.state import Faults, Ledger, SandboxState

STATUS = api_pb2.GenericResult


class FakeModal:
    """The fake's state and its lifecycle rules (expiry, vanishing, termination)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self.ledger = Ledger()
        self.faults = Faults()
        self.sandboxes: dict[str, SandboxState] = {}
        self.tasks: dict[str, SandboxState] = {}
        self.apps: dict[str, str] = {}
        self.images: dict[str, dict[str, Any]] = {}
        self.create_keys: dict[str, str] = {}
        self.counter = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def reset(self) -> None:
        """Clear the faults (the ledger stays: it is history)."""
        self.faults.reset()

    def images_commands(self) -> list[str]:
        """Every Dockerfile command of every image the client asked for."""
        return [command for image in self.images.values() for command in image["commands"]]

    @staticmethod
    def jwt() -> str:
        """A JWT-shaped token; the client reads ``exp`` and nobody checks the signature."""

        def part(value: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

        return f"{part({'alg': 'none'})}.{part({'exp': int(time.time()) + 3600})}.fake"

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- lifecycle -----------------------------------------------------------------------

    def expire(self, sandbox: SandboxState) -> None:
        """The sandbox's own ``timeout_secs`` ran out: Modal kills it (exit 124)."""
        if sandbox.running:
            sandbox.stop(STATUS.GENERIC_STATUS_TIMEOUT, 124)
            self.ledger.record_end(sandbox.sandbox_id, terminated=False)

    def vanish(self, sandbox: SandboxState) -> None:
        """Fault: the sandbox disappears mid-run; every later call about it is NOT_FOUND."""
        if sandbox.running:
            sandbox.stop(STATUS.GENERIC_STATUS_INTERNAL_FAILURE, 1)
            sandbox.vanished = True
            self.ledger.record_end(sandbox.sandbox_id, terminated=False)

    def terminate(self, sandbox: SandboxState) -> None:
        if sandbox.running:
            sandbox.stop(STATUS.GENERIC_STATUS_TERMINATED, 137)
            self.ledger.record_end(sandbox.sandbox_id, terminated=True)

    def kill_everything(self) -> None:
        for sandbox in self.sandboxes.values():
            if sandbox.running:
                sandbox.stop(STATUS.GENERIC_STATUS_TERMINATED, 137)
                self.ledger.record_end(sandbox.sandbox_id, terminated=False)

    # -- fault helpers the test thread may call -------------------------------------------

    def call(self, function: Any, *args: Any) -> None:
        """Run ``function(*args)`` on the fake's loop (for tests poking at its state)."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(function, *args)


async def _serve(fake: FakeModal, host: str, port: int, ready: threading.Event) -> None:
    fake.loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fake._stop = stop  # type: ignore[attr-defined]
    server = Server([ControlPlane(fake), Router(fake)])
    await server.start(host, port)
    listener = server._server  # grpclib keeps the asyncio server
    sockets = listener.sockets if isinstance(listener, asyncio.Server) else []
    bound = sockets[0].getsockname()[1]
    fake.url = f"http://{host}:{bound}"
    ready.set()
    try:
        await stop.wait()
    finally:
        fake.kill_everything()
        await asyncio.sleep(0.05)  # let the pumps see EOF and the waits answer
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)
        for task in list(fake._tasks):
            task.cancel()
        await asyncio.gather(*fake._tasks, return_exceptions=True)
        for sandbox in fake.sandboxes.values():
            sandbox.cleanup()


@contextlib.contextmanager
def running_fake(host: str = "127.0.0.1", port: int = 0) -> Iterator[FakeModal]:
    """Serve a fake Modal on ``host`` (a free port by default) until the block ends.

    On exit every subprocess it started is killed and every sandbox directory removed.
    """
    root = Path(tempfile.mkdtemp(prefix="fake-modal-"))
    fake = FakeModal(root)
    ready = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(_serve(fake, host, port, ready))
        except BaseException as exc:  # surfaced to the caller below
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="fake-modal", daemon=True)
    thread.start()
    ready.wait(10)
    if errors or not fake.url:
        raise RuntimeError("the fake Modal did not start") from (errors[0] if errors else None)
    try:
        yield fake
    finally:
        assert fake.loop is not None
        fake.loop.call_soon_threadsafe(fake._stop.set)  # type: ignore[attr-defined]
        thread.join(10)
        shutil.rmtree(root, ignore_errors=True)
