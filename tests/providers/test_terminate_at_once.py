"""A sandbox's end without a task where its provider ends it at once (``destroy_now``), and
the same outcome as the shielded terminate's task everywhere else."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from relay.errors import ProviderUnavailable
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.settings import Settings


def provider(at_once: bool) -> MemoryProvider:
    memory = MemoryProvider(Settings(_env_file=None), MemoryWorld())  # type: ignore[call-arg]
    if not at_once:  # the path every provider over a network takes
        memory.destroy_now = lambda sandbox_id: False  # type: ignore[method-assign]
    return memory


async def made(memory: MemoryProvider) -> str:
    sandbox = await memory.create(_Spec())  # type: ignore[arg-type]
    return sandbox.id


class _Spec:
    run_id, cluster, lifetime_s, tags = "run_1", "relay", 300.0, dict[str, str]()


def counting_tasks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    made: list[object] = []
    loop = asyncio.get_running_loop()
    create_task = loop.create_task

    def counted(*args: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(args[0])
        return create_task(*args, **kwargs)

    monkeypatch.setattr(loop, "create_task", counted)
    return made


async def test_a_sandbox_its_provider_ends_at_once_is_ended_without_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = provider(at_once=True)
    sandbox_id = await made(memory)
    tasks = counting_tasks(monkeypatch)
    await memory.ended(sandbox_id)
    assert tasks == []
    box = memory.world.boxes[sandbox_id]
    assert (box.alive, box.ended_by) == (False, "run")


@pytest.mark.parametrize("at_once", [True, False])
async def test_either_way_a_sandbox_ends_the_same(at_once: bool) -> None:
    memory = provider(at_once)
    sandbox_id = await made(memory)
    await memory.ended(sandbox_id)
    box = memory.world.boxes[sandbox_id]
    assert (box.alive, box.ended_by) == (False, "run")
    await memory.ended(sandbox_id)  # already gone: success, nothing raised


@pytest.mark.parametrize("at_once", [True, False])
async def test_either_way_a_failed_terminate_is_logged_and_raised_the_same(
    at_once: bool, caplog: pytest.LogCaptureFixture
) -> None:
    memory = provider(at_once)
    sandbox_id = await made(memory)
    memory.world.faults.terminate_failures = 1
    with (
        caplog.at_level(logging.ERROR, "relay.providers"),
        pytest.raises(ProviderUnavailable) as raised,
    ):
        await memory.ended(sandbox_id)
    assert str(raised.value) == "Memory is unavailable (terminating the sandbox)"
    assert type(raised.value.__cause__).__name__ == "MemoryAPIError"
    assert [record.getMessage() for record in caplog.records] == [
        f"memory sandbox {sandbox_id}: terminate failed (MemoryAPIError); the reaper will retry"
    ]
    assert memory.world.boxes[sandbox_id].alive  # left to the reaper
