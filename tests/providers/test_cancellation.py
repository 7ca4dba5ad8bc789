"""The lifecycle's cancellation primitives: a deadline that an SDK swallowing a cancellation
cannot outlive, and the shield that finishes cleanup whatever cancels its caller."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import Any

import anyio
import pytest

from relay.cancellation import Deadline, shielded
from relay.errors import ProviderError, ProviderTimeout, SandboxLost
from relay.providers.contract import SandboxSpec
from relay.providers.memory import MemoryAPIError, MemoryProvider, MemorySandbox
from relay.settings import Settings

SHORT_S = 0.05
LONG_S = 3.0  # never waited for: a test that waits this long has failed


async def swallow_then_wait() -> int:
    """A misbehaving SDK: eats the first cancellation, then awaits again."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(LONG_S)
    await asyncio.sleep(LONG_S)
    return 1


async def test_a_deadline_ends_a_block_that_swallows_its_cancellation() -> None:
    task = asyncio.current_task()
    assert task is not None
    started = time.monotonic()
    with pytest.raises(TimeoutError), Deadline(SHORT_S):
        await swallow_then_wait()
    assert time.monotonic() - started < 1.0
    assert task.cancelling() == 0


@pytest.mark.parametrize("given", [False, True], ids=["looked-up", "given"])
async def test_a_deadline_given_its_loop_ends_a_block_as_one_that_looks_it_up(
    given: bool,
) -> None:
    """A run's task passes the loop it holds (no ``getpid`` to look it up): the same bound,
    the same TimeoutError, the same task left behind; a block that does not wait, none."""
    loop = asyncio.get_running_loop() if given else None
    task = asyncio.current_task()
    assert task is not None
    started = time.monotonic()
    with pytest.raises(TimeoutError), Deadline(SHORT_S, loop):
        await swallow_then_wait()
    assert SHORT_S - 0.01 <= time.monotonic() - started < 1.0
    assert task.cancelling() == 0
    with Deadline(SHORT_S, loop) as deadline:
        pass
    assert not deadline.expired()
    await asyncio.sleep(SHORT_S * 2)  # its handle was cancelled: nothing lands later
    assert task.cancelling() == 0


async def test_a_cancellation_from_elsewhere_passes_a_deadline_as_it_came() -> None:
    async def waiting(swallow_first: bool) -> None:
        with Deadline(SHORT_S if swallow_first else LONG_S):
            if swallow_first:
                try:
                    await asyncio.sleep(LONG_S)
                except asyncio.CancelledError:
                    # Another canceller comes in while the deadline's own is handled.
                    current = asyncio.current_task()
                    assert current is not None
                    current.cancel()
            await asyncio.sleep(LONG_S)

    for swallow_first in (False, True):
        task = asyncio.create_task(waiting(swallow_first))
        await asyncio.sleep(0.01)
        if not swallow_first:
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1.0)
        assert task.cancelled()


async def test_nested_deadlines_each_raise_their_own_timeout() -> None:
    task = asyncio.current_task()
    assert task is not None
    with Deadline(LONG_S):
        with pytest.raises(TimeoutError), Deadline(SHORT_S):
            await asyncio.sleep(LONG_S)
        await asyncio.sleep(0)  # no cancellation left pending for the outer block
    started = time.monotonic()
    with pytest.raises(TimeoutError), Deadline(SHORT_S):
        try:
            with Deadline(LONG_S):
                await swallow_then_wait()
        except TimeoutError:
            pytest.fail("the inner block's time was not up: the outer's cancellation passes")
    assert time.monotonic() - started < 1.0
    assert task.cancelling() == 0


class StubbornProvider(MemoryProvider):
    """Its SDK's create swallows the first cancellation and goes on waiting."""

    async def create(self, spec: SandboxSpec) -> MemorySandbox:
        box = await super().create(spec)
        await swallow_then_wait()
        return box


async def test_a_deadline_arms_its_timer_once_its_block_waits_for_the_time_it_was_entered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counted(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        if isinstance(getattr(callback, "__self__", None), Deadline):
            armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted)
    with Deadline(LONG_S):  # a block that never waits: nothing could fire in it
        pass
    await asyncio.sleep(0)
    assert armed == []
    entered = loop.time()
    with pytest.raises(TimeoutError), Deadline(SHORT_S):
        time.sleep(SHORT_S / 2)  # the loop's clock moves before the first wait
        await asyncio.sleep(LONG_S)
    assert len(armed) == 1
    assert entered <= armed[0] - SHORT_S < entered + SHORT_S / 4
    assert loop.time() - entered < 1.0


async def test_a_deadline_that_passed_before_its_block_first_waits_ends_it_at_that_wait() -> None:
    task = asyncio.current_task()
    assert task is not None
    for delay_s in (0.0, SHORT_S):
        started = time.monotonic()
        with pytest.raises(TimeoutError), Deadline(delay_s):
            time.sleep(SHORT_S * 2)  # past the deadline without waiting
            await asyncio.sleep(LONG_S)
        assert time.monotonic() - started < 1.0
        assert task.cancelling() == 0
    with Deadline(0.0) as deadline:  # a block that never waits ends as it would have
        time.sleep(SHORT_S / 5)
    assert not deadline.expired()


async def test_a_create_that_swallows_the_cancellation_still_times_out_and_is_swept() -> None:
    provider = StubbornProvider(Settings())
    provider.create_timeout_s = SHORT_S
    spec = SandboxSpec(run_id="run_stubborn", cluster=provider.cluster, timeout_s=5)
    started = time.monotonic()
    with pytest.raises(ProviderTimeout):
        await provider.created(spec)
    assert time.monotonic() - started < 1.0
    [box] = provider.world.boxes.values()
    assert not box.alive and box.ended_by == "run"


async def ends_at_once() -> asyncio.Task[object] | None:
    return asyncio.current_task()


@pytest.mark.parametrize("cancels", [0, 1, 3])
async def test_shielded_work_finishes_whatever_cancels_its_caller(cancels: int) -> None:
    started, done = asyncio.Event(), []
    release: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def work() -> str:
        await asyncio.sleep(0)  # a bare turn of the loop
        started.set()
        value = await release  # a future of its own
        done.append(value)
        return f"{value} done"

    caller = asyncio.create_task(shielded(work()))
    await started.wait()
    for _ in range(cancels):
        caller.cancel()
        await asyncio.sleep(0)
    assert not caller.done() and not done
    release.set_result("cleanup")
    if cancels:
        with pytest.raises(asyncio.CancelledError):
            await caller
    else:
        assert await caller == "cleanup done"
    assert done == ["cleanup"]


async def test_shielded_raises_the_work_error_at_its_first_step_and_later() -> None:
    async def fails_at_once() -> None:
        raise ValueError("at once")

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise KeyError("later")

    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()

    with pytest.raises(ValueError, match="at once"):
        await shielded(fails_at_once())
    with pytest.raises(asyncio.CancelledError):  # as a task of its own would have ended
        await shielded(cancels_itself())
    with pytest.raises(KeyError, match="later"):
        await shielded(fails_later())
    assert await shielded(ends_at_once()) is not None  # the shield still works after


async def test_shielded_work_owns_what_it_entered_before_its_first_wait() -> None:
    """A deadline or a cancel scope entered before the work first waits belongs to the
    task that finishes the work, not to its caller, as with a task made for it."""
    caller = asyncio.current_task()
    assert caller is not None

    async def bounded() -> str:
        with Deadline(SHORT_S):
            await asyncio.sleep(LONG_S)
        return "not timed out"

    async def scoped() -> bool:
        with anyio.move_on_after(LONG_S) as scope:
            await asyncio.sleep(0.01)
        return scope.cancelled_caught

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await shielded(bounded())
    assert time.monotonic() - started < 1.0
    assert await shielded(scoped()) is False
    assert caller.cancelling() == 0


async def test_shielded_inside_shielded_work_and_no_task_left_over() -> None:
    async def nested(wait: bool) -> tuple[object, ...]:
        outer = asyncio.current_task()
        inner = await shielded(ends_at_once())
        if wait:
            await asyncio.sleep(0)
        waited = await shielded(fails_later_or(wait))
        return outer, inner, waited

    async def fails_later_or(wait: bool) -> str:
        await asyncio.sleep(0)
        return "waited" if wait else "not"

    before = asyncio.all_tasks()
    for wait in (False, True):
        outer, inner, waited = await shielded(nested(wait))
        assert outer is not inner and waited == ("waited" if wait else "not")
    await asyncio.sleep(0.01)
    spares = [task for task in asyncio.all_tasks() - before if not task.done()]
    assert len(spares) <= 1  # one idle spare at most


async def test_shielded_work_has_its_own_context() -> None:
    name: contextvars.ContextVar[str] = contextvars.ContextVar("name", default="caller")

    async def renames(wait: bool) -> str:
        name.set("work")
        if wait:
            await asyncio.sleep(0)
        return name.get()

    for wait in (False, True):
        assert await shielded(renames(wait)) == "work"
        assert name.get() == "caller"


async def test_shielded_takes_a_future_too() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(shielded(future))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0)
    assert not future.cancelled()
    future.set_result(3)
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_a_providers_block_maps_an_sdk_error_and_lets_a_cancellation_pass() -> None:
    provider = MemoryProvider(Settings(_env_file=None, providers=["memory"]))  # type: ignore[call-arg]
    sdk_error = MemoryAPIError(404, "no such sandbox")
    running = provider.mapping("running the command")
    with pytest.raises(SandboxLost, match="while running the command") as lost, running:
        raise sdk_error
    assert lost.value.__cause__ is sdk_error
    listing = provider.mapping("listing sandboxes", in_sandbox=False)
    with pytest.raises(ProviderError) as outside, listing:  # "gone" outside: not SandboxLost
        raise sdk_error
    assert type(outside.value) is ProviderError
    ours = ProviderTimeout("already the relay's")
    for passing in (ours, asyncio.CancelledError()):
        with pytest.raises(type(passing)) as raised, provider.mapping("uploading files"):
            raise passing
        assert raised.value is passing
    with provider.mapping("reading a file"):
        pass
