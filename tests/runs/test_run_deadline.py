"""A run's command ends at its deadline even where the provider's SDK swallows the
cancellation that ends it (relay/runs/run_task.py: the command runs under a Deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from relay.providers.contract import ExecResult, OutputSink, SandboxSpec
from relay.providers.memory import MemoryProvider, MemorySandbox, MemoryWorld
from relay.run_state import RunState
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus
from relay.runs.planning import Plan
from relay.runs.run_task import RunTask
from relay.store.records import RunRecord, RunValues
from tests.conftest import make_settings

TIMEOUT_S = 0.2
SWALLOWED_S = 5.0  # what the command would hold the run for with its cancellation lost


class SwallowingSandbox(MemorySandbox):
    """A sandbox whose SDK eats the first cancellation of a command, then waits again."""

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(SWALLOWED_S)
        await asyncio.sleep(SWALLOWED_S)
        return ExecResult(0)


class SwallowingProvider(MemoryProvider):
    async def create(self, spec: SandboxSpec) -> MemorySandbox:
        box = await self.world.create(self._api_key, self._client, spec)
        return SwallowingSandbox(self, box.id)


async def test_a_command_whose_sdk_swallows_the_deadlines_cancellation_still_times_out(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path, cluster="test")
    world = MemoryWorld()
    provider = SwallowingProvider(settings, world)
    spec = SandboxSpec(run_id="run_swallow", cluster="test", timeout_s=TIMEOUT_S, image="none")
    plan = Plan(
        job=None,
        provider="memory",
        argv=["sleep", "30"],
        env={},
        files={},
        stdin=None,
        workdir=None,
        timeout_s=TIMEOUT_S,
        spec=spec,
    )
    now = time.time()
    run = RunRecord(
        id="run_swallow",
        token="test",
        provider="memory",
        state=RunState.starting,
        request_hash="",
        timeout_s=TIMEOUT_S,
        created_at=now,
        deadline=now + 60,
        owner="test",
    )
    written: list[tuple[str, RunValues]] = []
    task = RunTask(
        plan,
        run,
        settings=settings,
        door=provider,
        events=EventBus(),
        costs=CostModel({"memory": provider}),
        record_running=lambda run_id, values: written.append((run_id, values)),
    )
    started = time.monotonic()
    final = await asyncio.wait_for(task.steps(), SWALLOWED_S * 3)
    assert final["state"] == RunState.timed_out
    assert time.monotonic() - started < SWALLOWED_S / 2  # ended near its deadline
    assert not world.alive()  # and its sandbox with it
