"""Cleanup no caller waits for: a provider's sweep after a failed create, and a terminate
still going when its run's answer is due.

A caller waits for its run's create (``RELAY_CREATE_TIMEOUT_S``) and command (the run's
timeout), and for its sandbox's terminate at most :data:`TERMINATE_WAIT_S`: a provider that
stops answering must not hold the answer longer. What follows goes on here, beside serving:
each piece bounded by its own deadline (the provider's ``sweep_timeout_s`` or
``terminate_timeout_s``), at most :data:`MOST_AT_ONCE` at a time, and ended when the provider
closes. A sandbox it could not end is the reaper's: its run is final by then, and a sweep
terminates every listed sandbox of a final run (relay/runs/reaper.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("relay.providers")

TERMINATE_WAIT_S = 2.0
"""How long a run's answer waits for its sandbox's terminate; past it the terminate goes on
here (within the provider's ``terminate_timeout_s``), the reaper behind it."""
MOST_AT_ONCE = 64
"""Pieces of cleanup going on at once per provider; past it the reaper alone does the rest."""
CLOSE_WAIT_S = 5.0
"""How long a closing provider lets its cleanup finish before it ends it."""


class Aftercare:
    """The cleanup one provider does beside serving."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def going(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The cleanup going on now (a test waits for what it started)."""
        return frozenset(self._tasks)

    def start(self, work: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any] | None:
        """Run ``work`` beside serving; None (``work`` closed unrun) past
        :data:`MOST_AT_ONCE`, the reaper then doing it."""
        if len(self._tasks) >= MOST_AT_ONCE:
            work.close()
            log.warning(
                "%s: too much cleanup at once; %s is left to the reaper",
                self.name,
                what,
                extra={"provider": self.name},
            )
            return None
        task = asyncio.create_task(_logged(work, self.name, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def adopt(self, task: asyncio.Task[Any], what: str) -> None:
        """Keep ``task`` (already going) until it ends; its failure is logged."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: _said(done, self.name, what))

    async def finish(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Let the cleanup going on end within ``timeout_s``, then end the rest (the
        reaper of the next sweep, or the next start, has it)."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if pending:
            log.warning(
                "%s: %d cleanup(s) still going at close were ended; the reaper has them",
                self.name,
                len(pending),
                extra={"provider": self.name},
            )


def _said(task: asyncio.Task[Any], name: str, what: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning(
            "%s: %s failed; the reaper retries it",
            name,
            what,
            extra={"provider": name, "error_class": type(task.exception()).__name__},
        )


async def _logged(work: Coroutine[Any, Any, Any], name: str, what: str) -> None:
    """``work``, its failure logged (its own lines say what; this one, that it ended so)."""
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning(
            "%s: %s failed; the reaper retries it",
            name,
            what,
            extra={"provider": name, "error_class": type(exc).__name__},
        )
