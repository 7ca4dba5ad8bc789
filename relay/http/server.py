"""The uvicorn server the relay runs under: on SIGTERM it drains with its listener open.

uvicorn alone, on SIGTERM, closes its listening socket at once (a new caller is refused
rather than told ``503 shutting_down``) and, once ``timeout_graceful_shutdown`` has passed,
cancels the requests still in flight before the app's shutdown has ended their runs: a
held ``wait: true`` caller got a plain-text 500 instead of its run. :class:`RelayServer`
puts the drain first: the first SIGTERM (or SIGINT) turns the run service to draining
(new runs answer ``503 shutting_down`` with ``Retry-After``) and lets its runs end, for at
most ``RELAY_DRAIN_S``, then cancels the rest (``canceled``, ``shutting_down``), all while
still serving, so every held caller gets its run as JSON. Only then does uvicorn's own
shutdown close the listener, let the answers go out and exit (status 0). A second signal
during the drain is uvicorn's usual way out: stop serving now.

``SIGHUP`` reloads the jobs folder (relay/runs/jobs_folder.py), as ``relay jobs reload`` does:
a folder that does not load leaves the last good jobs serving, says why in one log line and
on ``/readyz``. One that comes before the relay serves is kept for the moment it does (its
default action would end the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from relay.errors import JobsInvalid
from relay.http.app_state import AppState

log = logging.getLogger("relay.server")

YOUNG_COLLECTION_THRESHOLD = 10_000
"""Objects allocated (net) between two passes of the cyclic collector over the youngest
generation; Python's default is 700. A run's objects live as long as the run: at 700, a pass
comes every few runs and finds most of the runs in flight alive, moving them to the older
generations, whose passes then walk them again. The more runs in flight, the more each
pass moves: at 50 in flight the collector took 0.10 to 0.15 ms of a run's ~0.8 ms, at 10 about
0.03 ms (bench/README.md). At 10,000 the runs in flight are mostly gone by the next pass:
0.003 to 0.009 ms a run, for at most 10,000 objects more held between passes (well under a MB).
The relay makes little cyclic garbage (under 0.2 objects a run), so nothing waits longer to
be freed in practice."""


class RelayServer(uvicorn.Server):
    """uvicorn's server, with the relay's drain before its shutdown."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain: asyncio.Task[None] | None = None
        self._hangups = 0
        """SIGHUPs not yet handed to the loop (before the relay serves)."""
        self._reloading: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT and SIGTERM, and SIGHUP for a jobs reload, for the server's life."""
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():  # signals reach the main thread only
                yield
            return
        previous = signal.signal(signal.SIGHUP, self.handle_hangup)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        # Between two bytecodes of the loop's thread: hand the reload to the loop.
        if self._loop is None:
            self._hangups += 1
            return
        self._loop.call_soon_threadsafe(self._reload_jobs)

    def _reload_jobs(self) -> None:
        state: AppState | None = getattr(self.app.state, "relay", None)
        if state is None or state.jobs is None or self._draining:
            return
        task = asyncio.create_task(_reload(state))
        self._reloading.add(task)
        task.add_done_callback(self._reloading.discard)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self._hangups:
            self._hangups = 0
            self._reload_jobs()
        settle_heap()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state: AppState | None = getattr(self.app.state, "relay", None)
        if self._draining or state is None or self._loop is None:
            # A second signal, or one before the relay serves: uvicorn's own way.
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of the loop's thread: flip the
        # service at once, and hand the waiting to the loop.
        self._draining = True
        state.service.begin_drain()
        self._loop.call_soon_threadsafe(self._start_drain, state)

    def _start_drain(self, state: AppState) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit(state))

    async def _drain_then_exit(self, state: AppState) -> None:
        try:
            # Runs end (at most RELAY_DRAIN_S), the rest are canceled and written final:
            # their held callers answer before the listener closes.
            await state.service.shutdown()
        finally:
            self.should_exit = True


def settle_heap() -> None:
    """Set the collector up for serving, once the app is loaded: everything loaded so far
    (SDKs, schemas, the app) lives as long as the process, so it is kept out of the
    collector's full passes, which otherwise stall the loop for tens of milliseconds under
    load; and the youngest generation is collected every :data:`YOUNG_COLLECTION_THRESHOLD`
    allocations (bench/README.md). ``bench.extras`` does the same to the apps it drives."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD)


async def _reload(state: AppState) -> None:
    """A reload a signal asked for: its outcome is in the log (and on ``/readyz``)."""
    assert state.jobs is not None
    try:
        await state.jobs.reload()
    except JobsInvalid:
        pass  # logged by the jobs folder, with the file and the problem
    except Exception as exc:
        log.error("jobs reload failed", extra={"error_class": type(exc).__name__})
