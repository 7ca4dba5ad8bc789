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
        self._handle: asyncio.Handle = loop.call_at(loop.time() + self._delay_s, self._expire)
        return self

    def _expire(self) -> None:
        # Runs between the task's steps, so the block is still open: the cancellation lands
        # in it. Again next turn in case the body swallows it (anyio's re-delivery).
        if self._task.done():
            return  # a coroutine abandoned inside the block: nothing left to cancel
        self._cancels += 1
        self._task.cancel()
        self._handle = self._loop.call_soon(self._expire)

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
        _keep(spare)
        return cast(T, stop.value)
    except BaseException:
        _keep(spare)
        raise
    finally:
        asyncio.tasks._leave_task(loop, spare.task)
        asyncio.tasks._enter_task(loop, caller)
    spare.start.set_result((coroutine, yielded, context))
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


Started = tuple[Coroutine[Any, Any, Any], Any, contextvars.Context]
"""A coroutine stopped at its first wait, what it yielded there, and the context it runs in."""


class _Spare:
    """A task made ahead, waiting for a coroutine to carry on (see :func:`shielded`)."""

    __slots__ = ("loop", "start", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.start: asyncio.Future[Started] = loop.create_future()
        self.task: asyncio.Task[Any] = loop.create_task(_carried(self.start), name="shielded")
        # An idle spare left on a loop closed without cancelling its tasks is no leak.
        self.task._log_destroy_pending = False  # type: ignore[attr-defined]


class _Spares(threading.local):
    """The one idle spare of the loop running in this thread."""

    spare: _Spare | None = None


_spares = _Spares()


def _spare(loop: asyncio.AbstractEventLoop) -> _Spare:
    spare, _spares.spare = _spares.spare, None  # taken: a nested call makes its own
    if spare is not None and spare.loop is loop and _fit(spare):
        return spare
    if spare is not None:
        _drop(spare)  # another loop's, or one its borrower cancelled
    return _Spare(loop)


def _fit(spare: _Spare) -> bool:
    """Whether the work that borrowed it left it as made (it may cancel its own task)."""
    return not spare.start.done() and not spare.task.done() and spare.task.cancelling() == 0


def _keep(spare: _Spare) -> None:
    if _spares.spare is None and _fit(spare):
        _spares.spare = spare
    else:
        _drop(spare)  # one idle spare is enough (nested calls made a second)


def _drop(spare: _Spare) -> None:
    if not spare.task.done() and not spare.loop.is_closed():
        spare.task.cancel()


async def _carried(start: asyncio.Future[Started]) -> Any:
    coroutine, yielded, context = await start
    return await _continued(coroutine, yielded, context)


@types.coroutine
def _continued(
    coroutine: Coroutine[Any, Any, T], yielded: Any, context: contextvars.Context
) -> Generator[Any, Any, T]:
    """Drive a started coroutine on: its yields go to this task as they are (a future to
    wait for, or ``None`` for a bare turn of the loop), what comes back goes to it."""
    while True:
        thrown: BaseException | None = None
        try:
            sent = yield yielded
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as error:  # a cancellation, or a bad yield: the coroutine's
            thrown = error
        try:
            if thrown is None:
                yielded = context.run(coroutine.send, sent)
            else:
                yielded = context.run(coroutine.throw, thrown)
        except StopIteration as stop:
            return cast(T, stop.value)
