"""The lifecycle's two cancellation primitives, cheap enough to run several times a run.

:class:`Deadline` bounds a block as ``anyio.fail_after`` does (a cancellation the block
swallows is delivered again every turn of the loop, so an SDK that eats one still ends near
the deadline) for a timer handle and a few counters, not a cancel scope. :func:`shielded`
finishes a piece of cleanup whatever happens to its caller, and makes no task at all when the
cleanup ends without waiting (the memory provider's terminate, a local one already gone).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar, cast

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

    __slots__ = ("_before", "_cancels", "_delay_s", "_handle", "_loop", "_task")

    def __init__(self, delay_s: float) -> None:
        self._delay_s = delay_s
        self._cancels = 0

    def __enter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline needs a running task")
        self._loop, self._task = loop, task
        self._before = task.cancelling()
        self._handle: asyncio.Handle = loop.call_at(
            loop.time() + self._delay_s, self._expire, context=_EMPTY
        )
        return self

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
    raised again once the work is done; the work's result or exception is the caller's.

    The work runs in a task of its own, as if made by ``asyncio.ensure_future`` (its own
    copy of the caller's context, its own ``current_task()`` and cancellation count). A
    coroutine is started at once (3.12's eager tasks do the same), under a spare task's
    identity: if it ends without waiting, no task was used up and nothing waits on the loop;
    if it waits, that spare task carries it on from where it stopped. So a cancel scope or a
    lock the work enters before its first wait belongs to the task that finishes it.
    """
    if type(awaitable) is not types.CoroutineType:
        return await _shielded_task(asyncio.ensure_future(awaitable))
    coroutine = cast(Coroutine[Any, Any, T], awaitable)
    loop = asyncio.get_running_loop()
    caller = asyncio.current_task(loop)
    if caller is None:  # driven by hand, not by a task: nothing to borrow an identity from
        return await _shielded_task(asyncio.ensure_future(coroutine))
    spare = _spare(loop)
    context = contextvars.copy_context()
    asyncio.tasks._leave_task(loop, caller)
    asyncio.tasks._enter_task(loop, spare.task)
    try:
        yielded = context.run(coroutine.send, None)
    except StopIteration as stop:
        if _keep(spare):
            return cast(T, stop.value)
        raise asyncio.CancelledError from None  # as a task that cancelled itself ends
    except BaseException:
        _keep(spare)
        raise
    finally:
        asyncio.tasks._leave_task(loop, spare.task)
        asyncio.tasks._enter_task(loop, caller)
    spare.carry(coroutine, yielded, context)
    return cast(T, await _shielded_task(spare.task))


async def _shielded_task(task: asyncio.Future[T]) -> T:
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class _Spare(Coroutine[Any, Any, Any]):
    """A task made ahead, and the coroutine it runs: parked until handed a coroutine stopped
    at its first wait (see :func:`shielded`), then that coroutine's driver. Its yields go
    to the task as they are (a future to wait for, ``None`` for a bare turn of the loop),
    what the task sends or throws goes to it, in its own context."""

    __slots__ = ("_context", "_coroutine", "_first", "_parked", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._parked: asyncio.Future[None] = loop.create_future()
        self._coroutine: Coroutine[Any, Any, Any] | None = None
        self._first: Any = _NOTHING
        self.task: asyncio.Task[Any] = loop.create_task(self, name="shielded")
        # An idle spare left on a loop closed without cancelling its tasks is no leak.
        self.task._log_destroy_pending = False  # type: ignore[attr-defined]

    def fit(self) -> bool:
        """Whether the work that borrowed it left it as made (it may cancel its own task)."""
        return self._coroutine is None and not self.task.done() and not self.task.cancelling()

    def carry(
        self, coroutine: Coroutine[Any, Any, Any], yielded: Any, context: contextvars.Context
    ) -> None:
        self._coroutine, self._first, self._context = coroutine, yielded, context
        self.task._log_destroy_pending = True  # type: ignore[attr-defined]  # work: as a task's
        self._parked.set_result(None)  # wakes the task if it is parked already

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _NOTHING:
            self._first = _NOTHING
            return first  # a future it already waits for, its flag set by its __await__
        coroutine = self._coroutine
        if coroutine is None:  # not handed one yet: wait to be
            parked = self._parked
            parked._asyncio_future_blocking = True
            return parked
        return self._context.run(coroutine.send, value)

    def throw(self, kind: Any, value: Any = None, traceback: Any = None) -> Any:
        error = kind if value is None else value  # called as throw(error) by tasks
        coroutine = self._coroutine
        if coroutine is None:
            raise error  # cancelled while parked: the spare ends
        self._first = _NOTHING
        return self._context.run(coroutine.throw, error)

    def close(self) -> None:
        if self._coroutine is not None:
            self._coroutine.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("a spare is run by its task, never awaited")


_NOTHING: Any = object()


class _Spares(threading.local):
    """The one idle spare of the loop running in this thread."""

    spare: _Spare | None = None


_spares = _Spares()


def _spare(loop: asyncio.AbstractEventLoop) -> _Spare:
    spare, _spares.spare = _spares.spare, None  # taken: a nested call makes its own
    if spare is not None and spare.loop is loop and spare.fit():
        return spare
    if spare is not None:
        _drop(spare)  # another loop's, or one its borrower cancelled
    return _Spare(loop)


def _keep(spare: _Spare) -> bool:
    """Keep a spare that was only borrowed; False when the work cancelled its own task."""
    if not spare.fit():
        _drop(spare)
        return False
    if _spares.spare is None:
        _spares.spare = spare
    else:
        _drop(spare)  # one idle spare is enough (nested calls made a second)
    return True


def _drop(spare: _Spare) -> None:
    if not spare.task.done() and not spare.loop.is_closed():
        spare.task.cancel()
