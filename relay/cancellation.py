"""Cancellation, the relay's two tools for it: a deadline, and cleanup that must finish.

:class:`Deadline` bounds a block as ``anyio.fail_after`` does (a cancellation the block
swallows is delivered again every turn of the loop, so an SDK that eats one still ends near
the deadline) for a timer handle and a few counters, not a cancel scope, cheap enough to run
several times a run. :func:`shielded` awaits cleanup (terminating a sandbox, a final write)
to its end whatever cancels the caller. Ground: the providers' lifecycle, the runs and the
HTTP layer all use them. :class:`Alarms` are the bounds many runs set alike (a caller's wait,
the deferred `running` write), due in the order they were set, on one timer of the loop's.

A deadline's timer is armed only once the task waits inside its block: a timer's callback
cannot run while that task runs, so one armed for a block that ends without waiting (a
memory sandbox's create, a built-in command, a terminate answered at once) was armed and
cancelled for nothing. A ``call_soon`` arms it, at the same due time, on the loop's next
turn, before the task can run again; a block that has ended by then cancels that handle
instead (under uvloop a ``call_soon`` and its cancel cost a fifth of a timer's).
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

_EMPTY = contextvars.Context()
"""What a deadline's callback runs in: it reads no variable, so the caller's isn't copied."""


class Deadline:
    """Cancel the enclosing task's block once ``delay_s`` has passed; raise TimeoutError.

    Used as ``with Deadline(seconds):`` inside a task. When the time is up the task is
    cancelled, and again every turn of the loop until the block ends, so a body that swallows
    a :class:`asyncio.CancelledError` and awaits again is cancelled again. A block ended by
    its own cancellation raises :class:`TimeoutError`; a cancellation from elsewhere (another
    ``Task.cancel()``, an outer deadline) passes through as it came. Every cancellation this
    block made is taken back (``Task.uncancel``) when it ends, so ``cancelling()`` reads as
    before. A body that swallows the cancellation and returns ends normally, as in anyio.
    """

    __slots__ = ("_before", "_cancels", "_delay_s", "_due", "_given", "_handle", "_loop", "_task")

    def __init__(self, delay_s: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``loop``: the loop the block runs in, when the caller holds it already (its
        ``asyncio.get_running_loop()`` is a ``getpid`` system call on Python 3.11)."""
        self._delay_s = delay_s
        self._cancels = 0
        self._given = loop

    def __enter__(self) -> Deadline:
        loop = self._given
        if loop is None:
            loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline needs a running task")
        self._loop, self._task = loop, task
        self._before = task.cancelling()
        delay_s = self._delay_s
        if delay_s <= 0:  # already up: cancelled once the body first waits
            self._handle: asyncio.Handle = loop.call_soon(self._expire, context=_EMPTY)
            return self
        # The timer, once the body waits (see the module's docstring): at the same time.
        self._due = loop.time() + delay_s
        self._handle = loop.call_soon(self._arm, context=_EMPTY)
        return self

    def _arm(self) -> None:
        self._handle = self._loop.call_at(self._due, self._expire, context=_EMPTY)

    def expired(self) -> bool:
        """Whether the time ran out (its cancellation was delivered), as
        ``asyncio.Timeout.expired``."""
        return self._cancels > 0

    def _expire(self) -> None:
        # Runs between the task's steps, so the block is still open: the cancellation lands
        # in it. Again next turn in case the body swallows it (anyio's re-delivery).
        if self._task.done():
            return  # a coroutine abandoned inside the block: nothing left to cancel
        self._cancels += 1
        self._task.cancel()
        self._handle = self._loop.call_soon(self._expire, context=_EMPTY)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self._handle.cancel()
        cancels = self._cancels
        if not cancels:
            return
        task = self._task
        for _ in range(cancels):
            task.uncancel()
        if kind is asyncio.CancelledError and task.cancelling() <= self._before:
            raise TimeoutError from error


async def shielded(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to the end even if the caller is cancelled, any number of times.

    Cleanup such as terminating a sandbox must finish; ``anyio.CancelScope(shield=True)``
    does not stop a native ``Task.cancel()``, this does. The caller's cancellation is
    raised again once the work is done.
    """
    task = asyncio.ensure_future(awaitable)
    cancelled = await finished_within(task, None)
    result = task.result()  # its own error (or its own cancellation) first
    if cancelled:
        raise asyncio.CancelledError
    return result


class _Waiter:
    """The one future a :func:`finished_within` caller awaits, woken by the work's end or
    the timer; a new one after each cancellation of the caller (which cancels the one it
    awaited)."""

    __slots__ = ("future", "woken")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future, self.woken = future, False

    def wake(self, _: object = None) -> None:
        self.woken = True
        if not self.future.done():
            self.future.set_result(None)


async def finished_within(work: asyncio.Future[T], seconds: float | None) -> bool:
    """Wait until ``work`` is done or ``seconds`` have passed (None: no bound), whatever
    cancels the caller, any number of times; ``work`` is never cancelled by it. Returns
    whether the caller was cancelled meanwhile: it must raise that again once it has
    dealt with ``work``. One future and one timer, where ``shielded`` around
    ``asyncio.wait`` took a second task, a shield's future and a waiter set: a sandbox's
    terminate waits through this on every run."""
    if work.done():
        return False
    loop = asyncio.get_running_loop()
    waiter = _Waiter(loop.create_future())
    work.add_done_callback(waiter.wake)
    timer = None if seconds is None else loop.call_later(seconds, waiter.wake)
    cancelled = False
    try:
        while not waiter.woken:
            try:
                await waiter.future
            except asyncio.CancelledError:
                cancelled = True
                if not waiter.future.cancelled():
                    break  # woken as the cancel came: done waiting
                waiter.future = loop.create_future()
    finally:
        if timer is not None:
            timer.cancel()
        work.remove_done_callback(waiter.wake)
    return cancelled


_ALARM_RESOLUTION_S = 0.001
"""A loop's timer may fire this much before its time (uvloop's are whole milliseconds): an
alarm due within it is due."""


class Alarms:
    """Callbacks each due a delay after it was set, on one timer of the loop's for all of
    them, armed for the earliest: where every run sets a bound and nearly every run clears
    it long before (a caller's wait, the deferred `running` write), a dict entry set and
    popped costs half a timer armed and cancelled, and the loop's timer heap holds one.
    A key set again replaces its alarm: it rings once, at the new time.

    With one delay they are due in the order they were set, so the timer only moves on
    when it fires. One due before the last set gets a timer of its own. A callback runs
    in the context it was set in, as ``call_later``'s; one that raises is reported to the
    loop's exception handler and the others still run."""

    __slots__ = ("_apart", "_last", "_loop", "_queued", "_timer")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: dict[
            Hashable, tuple[float, Callable[..., object], tuple[Any, ...], contextvars.Context]
        ] = {}
        self._apart: dict[Hashable, asyncio.TimerHandle] = {}
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def set(
        self, key: Hashable, delay_s: float, callback: Callable[..., object], *args: Any
    ) -> None:
        """Call ``callback(*args)`` in ``delay_s`` unless :meth:`clear` (``key``) comes first."""
        self.set_on(asyncio.get_running_loop(), key, delay_s, callback, *args)

    def set_on(
        self,
        loop: asyncio.AbstractEventLoop,
        key: Hashable,
        delay_s: float,
        callback: Callable[..., object],
        *args: Any,
    ) -> None:
        """:meth:`set`, from a caller running in ``loop`` that holds it already (a run's
        task: ``asyncio.get_running_loop()`` is a ``getpid`` system call on Python 3.11)."""
        if loop is not self._loop:  # a loop of its own (a test's): the last one's are gone
            self._loop, self._queued, self._apart, self._timer = loop, {}, {}, None
            self._last = 0.0
        elif self._queued.pop(key, None) is None and self._apart:
            # Set again: the first is replaced, not moved (a queued key would keep its place
            # with the new time, holding back those after it, or ring twice). One lookup
            # for a key not set, as a run's is.
            timer = self._apart.pop(key, None)
            if timer is not None:
                timer.cancel()
        due = loop.time() + delay_s
        if due < self._last:
            self._apart[key] = loop.call_at(due, self._due_apart, key, callback, *args)
            return
        self._last = due
        self._queued[key] = (due, callback, args, contextvars.copy_context())
        if self._timer is None:
            self._timer = loop.call_at(due, self._fire, context=_EMPTY)

    def clear(self, key: Hashable) -> None:
        """The alarm set under ``key`` is not wanted (nothing if it was not set, or rang)."""
        if self._queued.pop(key, None) is None:
            timer = self._apart.pop(key, None)
            if timer is not None:
                timer.cancel()

    def __contains__(self, key: Hashable) -> bool:
        """Whether an alarm is set under ``key`` (not rung, not cleared)."""
        return key in self._queued or key in self._apart

    def __len__(self) -> int:
        return len(self._queued) + len(self._apart)

    def _due_apart(self, key: Hashable, callback: Callable[..., object], *args: Any) -> None:
        self._apart.pop(key, None)
        callback(*args)

    def _fire(self) -> None:
        loop, queued = self._loop, self._queued
        assert loop is not None
        self._timer = None
        now = loop.time() + _ALARM_RESOLUTION_S
        while queued:
            key = next(iter(queued))
            due, callback, args, context = queued[key]
            if due > now:  # the next one's time (those set before it were cleared)
                self._timer = loop.call_at(due, self._fire, context=_EMPTY)
                return
            del queued[key]
            try:
                context.run(callback, *args)
            except Exception as exc:
                loop.call_exception_handler(
                    {"message": "an alarm's callback failed", "exception": exc}
                )
