"""Runs that end at awkward moments still end, with their sandbox, and are reported.

In-process relays (testing/chaos.py) on one SQLite file and one in-memory provider world:
a DELETE or a shutdown that arrives before the run's task has taken a step, a DELETE through another
replica while the owner is still creating the sandbox (no sandbox id yet for the other
replica to terminate), and a final write that fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relay.runs.event_bus import RunEvent
from relay.runs.models import RunRequest
from relay.store.database import Store
from testing.chaos import PRINCIPAL, MemoryBackend, Relay


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[MemoryBackend, Store, Path]]:
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    yield MemoryBackend(), store, tmp_path
    await store.close()


def long_run() -> RunRequest:
    return RunRequest(command=["sleep", "30"], timeout_s=60, wait=False)


async def test_a_cancel_before_the_run_takes_a_step_closes_it(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})
    run, _ = await relay.service.submit(PRINCIPAL, long_run(), None)
    canceled = await relay.service.cancel(PRINCIPAL, run.id)  # no await in between
    assert canceled.state == "canceled"
    # Whether the task got as far as creating a sandbox or not, none is left running.
    assert all(box.ended_by == "run" for box in backend.world.boxes.values())
    assert relay.service.active_runs == 0


async def test_a_shutdown_before_the_run_takes_a_step_closes_it(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})  # drain_s=0: shutdown stops runs at once
    run, _ = await relay.service.submit(PRINCIPAL, long_run(), None)
    await relay.service.shutdown()  # no await in between: the run's task never stepped
    closed = await store.get_run(run.id)
    assert closed is not None
    assert (closed.state, closed.error_code) == ("canceled", "shutting_down")
    assert backend.world.boxes == {}  # nothing was ever created
    assert relay.service.active_runs == 0


async def test_a_cancel_through_another_replica_during_create_ends_the_sandbox(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    backend, store, tmp = world
    owner, other = Relay(store, backend, tmp, {}), Relay(store, backend, tmp, {})
    backend.world.faults.create_delay_s = 0.3
    seen: list[RunEvent] = []
    other.service.events.subscribe(seen.append)
    run, _ = await owner.service.submit(PRINCIPAL, long_run(), None)
    await asyncio.sleep(0.05)  # the owner is inside the provider's create call
    assert (await store.get_run(run.id)).state == "starting"  # type: ignore[index]
    canceled = await other.service.cancel(PRINCIPAL, run.id)
    assert canceled.state == "canceled"
    started = time.monotonic()
    await owner.service.wait(run.id, 10)
    [box] = backend.world.boxes.values()
    # The owner finds the run final when it writes `running`, and ends the sandbox at
    # once instead of letting the 30 s job run out.
    assert not box.alive and box.ended_by == "run"
    assert time.monotonic() - started < 5
    final = await store.get_run(run.id)
    assert final is not None and final.state == "canceled"
    # The replica that canceled it tells its metrics, webhooks and streams.
    assert [(e.kind, e.state) for e in seen] == [("finished", "canceled")]


async def test_a_failed_final_write_answers_the_waiter_and_lands_once_the_store_is_back(
    world: tuple[MemoryBackend, Store, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})

    async def store_down(*args: object, **kwargs: object) -> bool:
        raise OSError("disk full")

    monkeypatch.setattr(relay.store, "finish_run", store_down)
    request = RunRequest(command=["sleep", "0.01"], timeout_s=0.2, wait=False)
    run, _ = await relay.service.submit(PRINCIPAL, request, None)
    # A caller held on `wait` gets the outcome at once, not when its wait runs out.
    seen = await asyncio.wait_for(relay.service.wait(run.id, 30), 2)
    assert seen.state == "succeeded"  # the outcome, kept in memory meanwhile
    assert relay.service.holds(run.id)  # so the reaper leaves it alone
    relay.reaper.grace_s = 0
    await asyncio.sleep(max(0.0, seen.deadline - time.time()) + 0.05)
    report = await relay.reaper.sweep()
    assert report.lost_runs == []
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    final = await store.get_run(run.id)
    while (final is None or final.state != "succeeded") and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        final = await store.get_run(run.id)
    assert final is not None and final.state == "succeeded"
    assert not relay.service.holds(run.id)
    assert not any(box.alive for box in backend.world.boxes.values())


async def test_running_is_stored_soon_and_a_quick_run_is_written_once_with_its_sandbox(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})
    slow, _ = await relay.service.submit(
        PRINCIPAL, RunRequest(command=["sleep", "0.6"], timeout_s=10, wait=False), None
    )
    await asyncio.sleep(0.3)  # well past the deferred write
    stored = await store.get_run(slow.id)
    assert stored is not None and stored.state == "running" and stored.sandbox_id
    quick, _ = await relay.service.submit(
        PRINCIPAL, RunRequest(command=["true"], timeout_s=10, wait=False), None
    )
    done = await relay.service.wait(quick.id, 5)
    assert done.state == "succeeded"
    final = await store.get_run(quick.id)
    assert final is not None and final.sandbox_id == done.sandbox_id is not None
    assert final.started_at is not None and final.duration_ms is not None
    assert (await relay.service.wait(slow.id, 5)).state == "succeeded"


async def test_a_cancel_during_the_final_write_leaves_the_outcome_to_land(
    world: tuple[MemoryBackend, Store, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job has ended and its final state is being written when a DELETE (then a
    shutdown) arrives: the write is not interrupted, the run keeps its own outcome."""
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})
    writing, release = asyncio.Event(), asyncio.Event()
    finish_run = store.finish_run

    async def slow_finish(*args: Any, **kwargs: Any) -> bool:
        writing.set()
        await release.wait()
        return await finish_run(*args, **kwargs)

    monkeypatch.setattr(relay.store, "finish_run", slow_finish)
    request = RunRequest(command=["echo", "done"], timeout_s=10, wait=False)
    run, _ = await relay.service.submit(PRINCIPAL, request, None)
    [task] = relay.service.runner.tasks()
    await asyncio.wait_for(writing.wait(), 5)
    relay.service.runner.stop(run.id, "canceled")
    relay.service.begin_drain()
    shutdown = asyncio.create_task(relay.service.shutdown())
    await asyncio.sleep(0.05)  # both reached the run's task before the write answers
    release.set()
    await asyncio.wait_for(shutdown, 5)
    final = await store.get_run(run.id)
    assert final is not None
    assert (final.state, final.stdout, final.error_code) == ("succeeded", "done\n", None)
    assert task.done() and not task.cancelled()
    assert not relay.service.holds(run.id)
    assert not any(box.alive for box in backend.world.boxes.values())


async def test_a_run_still_ending_after_the_shutdown_answers_its_waiter(
    world: tuple[MemoryBackend, Store, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The provider does not answer the terminate of a run the shutdown canceled: its held
    `wait` caller gets the run as it is once the shutdown is done, not when the server
    cancels the request (a bare 500)."""
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})  # drain_s=0, create_timeout_s=0.1
    released = asyncio.Event()
    destroy = relay.provider.inner.destroy

    async def unanswered(sandbox_id: str) -> None:
        await released.wait()
        await destroy(sandbox_id)

    monkeypatch.setattr(relay.provider.inner, "destroy", unanswered)
    monkeypatch.setattr(relay.provider.inner, "destroy_now", lambda sandbox_id: False)
    run, _ = await relay.service.submit(PRINCIPAL, long_run(), None)
    await asyncio.sleep(0.2)  # running
    waiter = asyncio.create_task(relay.service.wait(run.id, 30))
    await asyncio.wait_for(relay.service.shutdown(), 5)
    seen = await asyncio.wait_for(waiter, 1)
    assert seen.id == run.id and seen.state == "running"
    released.set()  # the provider answers after all: the run is written final
    for _ in range(50):
        final = await store.get_run(run.id)
        if final is not None and final.state != "running":
            break
        await asyncio.sleep(0.1)
    assert final is not None and (final.state, final.error_code) == ("canceled", "shutting_down")
    assert not any(box.alive for box in backend.world.boxes.values())


async def _ended_under_a_hanging_terminate(
    relay: Relay, backend: MemoryBackend, exit_code: int
) -> str:
    """A run whose command ``echo done; exit {exit_code}`` has ended while its sandbox's
    terminate does not answer; its id."""
    backend.world.faults.terminate_hang = True
    run, _ = await relay.service.submit(
        PRINCIPAL,
        RunRequest(command=["sh", "-c", f"echo done; exit {exit_code}"], wait=False),
        None,
    )
    for _ in range(100):  # the command has ended; the terminate does not answer
        if any(c.ended for box in backend.world.boxes.values() for c in box.commands):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    return run.id


async def _final_once_released(store: Store, backend: MemoryBackend, run_id: str) -> Any:
    """The run as written final (the terminate goes on, bounded, then the write), the hung
    terminate released after."""
    final = None
    for _ in range(50):
        final = await store.get_run(run_id)
        if final is not None and final.state.final:
            break
        await asyncio.sleep(0.1)
    backend.world.reset()
    assert final is not None
    return final


async def test_a_job_that_ended_before_the_shutdown_keeps_its_outcome(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    """The shutdown stops a run whose command has ended while its sandbox is being
    terminated: the run is the job's outcome (it read canceled, its exit code lost)."""
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})  # drain_s=0: shutdown stops runs at once
    run_id = await _ended_under_a_hanging_terminate(relay, backend, 3)
    await relay.service.shutdown()
    final = await _final_once_released(store, backend, run_id)
    assert (final.state, final.exit_code, final.stdout) == ("failed", 3, "done\n")


@pytest.mark.parametrize(("exit_code", "outcome"), [(0, ("succeeded", 0)), (3, ("canceled", None))])
async def test_a_job_that_ended_before_a_delete_keeps_its_outcome(
    world: tuple[MemoryBackend, Store, Path], exit_code: int, outcome: tuple[str, int | None]
) -> None:
    """A DELETE that reaches a run whose job has succeeded while its sandbox is being
    terminated came too late to stop anything: the run is the job's success, its exit code
    and output kept (it read canceled, the finished job's result dropped). A job that failed
    reads canceled with its output, as one canceled through another replica does: its
    failure may be the cancel's own doing (relay/runs/final_writes.py)."""
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})
    run_id = await _ended_under_a_hanging_terminate(relay, backend, exit_code)
    delete = asyncio.create_task(relay.service.cancel(PRINCIPAL, run_id))
    final = await _final_once_released(store, backend, run_id)
    await delete
    await relay.service.shutdown()
    assert (final.state, final.exit_code, final.stdout) == (*outcome, "done\n")


async def test_an_upload_that_never_answers_ends_at_the_jobs_timeout(
    world: tuple[MemoryBackend, Store, Path],
) -> None:
    """Uploading the job's files counts against its timeout: a provider that stops
    answering after the create must not hold the run (and its sandbox) for ever, unseen by
    the reaper, which leaves a run this process holds alone."""
    backend, store, tmp = world
    relay = Relay(store, backend, tmp, {})
    backend.world.faults.upload_hang = True
    request = RunRequest(command=["true"], files={"a.txt": "a"}, timeout_s=1, wait=False)
    run, _ = await relay.service.submit(PRINCIPAL, request, None)
    started = time.monotonic()
    try:
        await relay.service.wait(run.id, 5)
        ended = await store.get_run(run.id)
        assert ended is not None and ended.state == "timed_out"
        assert time.monotonic() - started < 3
        assert all(not box.alive for box in backend.world.boxes.values())
    finally:
        backend.world.reset()  # releases a hung upload, so a failure still tears down
        await relay.service.shutdown()
