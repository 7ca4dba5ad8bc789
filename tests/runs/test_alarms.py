"""Alarms: many runs' bounds on one timer of the loop's, each rung at its own time, as a
timer of its own would."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import sys
from pathlib import Path
from typing import Any

import pytest

from relay.cancellation import Alarms
from relay.runs.models import RunRequest
from relay.store.database import Store
from testing.chaos import PRINCIPAL, MemoryBackend, Relay

STEP_S = 0.03


def timers_armed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The callbacks of the timers armed from now on, but for the test's own sleeps."""
    armed: list[object] = []
    loop = asyncio.get_running_loop()
    call_at = loop.call_at

    def counted_at(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__name__", "") != "_set_result_unless_cancelled":  # a sleep
            armed.append(callback)
        return call_at(when, callback, *args, **kwargs)

    def counted_later(delay: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        return counted_at(loop.time() + delay, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted_at)
    monkeypatch.setattr(loop, "call_later", counted_later)
    return armed


def _method(callback: object) -> object:
    """The function a bound method calls (None for any other callback)."""
    return getattr(callback, "__func__", None)


async def test_alarms_of_one_delay_ring_in_order_each_at_its_own_time() -> None:
    loop = asyncio.get_running_loop()
    alarms, rang = Alarms(), list[tuple[str, float]]()
    set_at: dict[str, float] = {}
    for name in ("a", "b", "c", "d"):
        set_at[name] = loop.time()
        alarms.set(name, STEP_S * 2, lambda name: rang.append((name, loop.time())), name)
        await asyncio.sleep(STEP_S / 3)
    alarms.clear("b")  # cleared before its time: never rings
    alarms.clear("never set")
    await asyncio.sleep(STEP_S * 3)
    assert [name for name, _ in rang] == ["a", "c", "d"]
    for name, when in rang:  # each at its own time, not at the first one's
        assert when >= set_at[name] + STEP_S * 2 - 0.002


async def test_many_alarms_of_one_delay_take_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    alarms, rang = Alarms(), list[int]()
    armed = timers_armed(monkeypatch)
    for number in range(50):
        alarms.set(number, STEP_S, rang.append, number)
    for number in range(0, 50, 2):
        alarms.clear(number)
    await asyncio.sleep(STEP_S * 3)
    assert rang == list(range(1, 50, 2))
    assert len(armed) <= 3


async def test_an_alarm_due_before_the_last_set_still_rings_first_and_clears() -> None:
    loop = asyncio.get_running_loop()
    alarms, rang = Alarms(), list[str]()
    alarms.set("late", STEP_S * 3, rang.append, "late")
    alarms.set("early", STEP_S, rang.append, "early")
    alarms.set("cleared", STEP_S, rang.append, "cleared")
    alarms.clear("cleared")
    started = loop.time()
    while len(rang) < 2 and loop.time() - started < 1:
        await asyncio.sleep(STEP_S / 3)
    assert rang == ["early", "late"]


async def test_an_alarm_set_again_rings_once_at_its_new_time_in_its_new_place() -> None:
    """A second set of a key replaces the first: it rings once, at the new time, and the
    alarms set between ring at theirs (the key kept its first place with the new due time:
    "b" rang late, behind it; one moved earlier rang twice)."""
    loop = asyncio.get_running_loop()
    alarms, rang = Alarms(), list[tuple[str, float]]()
    started = loop.time()

    def ring(name: str) -> None:
        rang.append((name, loop.time() - started))

    alarms.set("a", STEP_S, ring, "a")
    alarms.set("b", STEP_S * 2, ring, "b")
    alarms.set("a", STEP_S * 6, ring, "a")  # later: after "b"
    alarms.set("c", STEP_S * 3, ring, "c")
    alarms.set("c", STEP_S / 2, ring, "c")  # earlier than every other: first, once
    while len(rang) < 3 and loop.time() - started < 1:
        await asyncio.sleep(STEP_S / 3)
    await asyncio.sleep(STEP_S * 2)  # nothing rings twice
    assert [name for name, _ in rang] == ["c", "b", "a"]
    times = dict(rang)
    assert times["b"] < STEP_S * 5  # at its own time, not held behind "a"
    assert times["a"] >= STEP_S * 6 - 0.002
    assert len(alarms) == 0


async def test_an_alarm_rings_in_the_context_it_was_set_in_and_a_failing_one_stops_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    which: contextvars.ContextVar[str] = contextvars.ContextVar("which", default="none")
    alarms, seen = Alarms(), list[str]()

    def failing() -> None:
        raise ValueError("broken")

    which.set("first")
    alarms.set(1, STEP_S, lambda: seen.append(which.get()))
    alarms.set(2, STEP_S, failing)
    which.set("second")
    alarms.set(3, STEP_S, lambda: seen.append(which.get()))
    which.set("after")
    await asyncio.sleep(STEP_S * 3)
    assert seen == ["first", "second"]
    assert "an alarm's callback failed" in caplog.text


async def test_a_callers_wait_ends_at_its_bound_and_arms_one_timer_for_many_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relay.runs.runner import _Done

    alarms = Alarms()
    armed = timers_armed(monkeypatch)
    done = [_Done(alarms, asyncio.get_running_loop()) for _ in range(20)]
    waits = [asyncio.create_task(event.wait(STEP_S * 2)) for event in done]
    await asyncio.sleep(0)
    for event in done[:19]:  # nineteen runs end at once; one outlasts its caller's wait
        event.set()
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*waits)
    assert asyncio.get_running_loop().time() - started >= STEP_S * 2 - 0.01
    assert len(armed) <= 2


async def test_runs_that_end_at_once_arm_no_timer_and_no_task_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty runs of a built-in on memory, each waited for: their caller's wait, deferred
    `running` write, sandbox lifetime and terminate take no timer or task a run (a kind of
    alarm shared with another of a different delay would arm one a run again)."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        relay = Relay(store, MemoryBackend(), tmp_path, {})
        loop = asyncio.get_running_loop()
        armed = timers_armed(monkeypatch)
        tasks: list[object] = []
        create_task = loop.create_task

        def counted(coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            tasks.append(coro)
            return create_task(coro, **kwargs)

        monkeypatch.setattr(loop, "create_task", counted)
        for _ in range(20):
            run, _created = await relay.service.submit(
                PRINCIPAL, RunRequest(command=["true"], wait=True), None
            )
            finished = await relay.service.wait(run.id, 30)
            assert finished.state == "succeeded"
        # Each kind's one timer: an Alarms' own, re-armed as it rings, as often as the runs
        # outlast its delay (0.05 s for the `running` write: many times on a loaded host),
        # so counted once; no other timer a run.
        fires = [callback for callback in armed if _method(callback) is Alarms._fire]
        kinds = {id(getattr(callback, "__self__", None)) for callback in fires}
        assert len(kinds) + len(armed) - len(fires) <= 6, armed
        assert len(tasks) == 20  # the runs' own
    finally:
        await store.close()


async def test_a_run_looks_its_loop_up_once_and_its_bounds_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.get_running_loop()`` is a ``getpid`` system call each time: a
    run's task, its caller's wait, its deferred `running` write and its command's deadline
    use the loop the runner looked up when it started the run (the memory provider's create
    asks once more for its deadline and its sandbox's lifetime). Before, a run asked 7 times."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        relay = Relay(store, MemoryBackend(), tmp_path, {})
        for _ in range(2):  # the store's first writes, not counted
            run, _created = await relay.service.submit(
                PRINCIPAL, RunRequest(command=["true"], wait=True), None
            )
            await relay.service.wait(run.id, 30)
        asked = list[str]()
        real = asyncio.get_running_loop

        def counted() -> asyncio.AbstractEventLoop:
            caller = sys._getframe(1).f_code
            if "/relay/store/" not in caller.co_filename:  # the store's own, the floor's too
                asked.append(f"{caller.co_filename}:{caller.co_name}")
            return real()

        monkeypatch.setattr(asyncio, "get_running_loop", counted)
        monkeypatch.setattr(asyncio.events, "get_running_loop", counted)
        for _ in range(20):
            run, _created = await relay.service.submit(
                PRINCIPAL, RunRequest(command=["true"], wait=True), None
            )
            finished = await relay.service.wait(run.id, 30)
            assert finished.state == "succeeded"
        # the runner's, and the memory provider's create's two
        assert len(asked) == 20 * 3, collections.Counter(asked)
    finally:
        await store.close()
