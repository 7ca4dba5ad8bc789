"""The shipped memory provider under the contract: its world is the ground truth."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay.errors import ProviderError
from relay.providers.contract import OutputSink, SandboxSpec
from relay.providers.memory import API_KEY, HISTORY, MemoryProvider, MemoryWorld
from tests.conftest import make_settings
from tests.contract.artifact_suite import ArtifactContract
from tests.contract.fault_suite import FaultContract
from tests.contract.suite import ProviderContract


class TestMemory(ProviderContract, ArtifactContract, FaultContract, rig="memory"):
    """The contract on the in-memory provider."""


async def test_a_builtin_that_ends_at_once_needs_no_task_and_a_bad_one_fails_at_once(
    tmp_path: Path,
) -> None:
    """`true` has ended when the world starts it (no task, no wait); `exit abc` is an
    error the relay hears at once, where it used to leave the command running to its
    deadline."""
    world = MemoryWorld()
    provider = MemoryProvider(make_settings(tmp_path, cluster="test"), world)
    spec = SandboxSpec(run_id="run_eager", cluster="test", timeout_s=30, grace_s=10, image="none")
    async with provider.sandbox(spec) as sandbox:
        box = world.boxes[sandbox.id]
        done = world.start(API_KEY, sandbox.id, lambda command: 0)
        assert done.ended and done.exit_code == 0 and done.task is None
        assert not box.commands
        sink = OutputSink(1024)
        async with asyncio.timeout(2):
            with pytest.raises(ProviderError):
                await sandbox.exec(
                    ["exit", "abc"], stdin=None, env={}, workdir=None, timeout_s=30, output=sink
                )
            ran = await sandbox.exec(
                ["echo", "hi"], stdin=None, env={}, workdir=None, timeout_s=30, output=sink
            )
        assert ran.exit_code == 0 and sink.text("stdout") == "hi\n"


@pytest.mark.parametrize(
    "argv", [["sh", "-c", "echo a; exit abc"], ["sh", "-c", "echo 'a"], ["sleep"], ["sleep", "x"]]
)
async def test_a_bad_script_or_sleep_fails_at_once(tmp_path: Path, argv: list[str]) -> None:
    """A script or `sleep` that is bad fails as a bad built-in does, at once; it left its
    command running to the run's deadline (its task dead with the error unread)."""
    world = MemoryWorld()
    provider = MemoryProvider(make_settings(tmp_path, cluster="test"), world)
    spec = SandboxSpec(run_id="run_bad", cluster="test", timeout_s=30, grace_s=10, image="none")
    async with provider.sandbox(spec) as sandbox:
        box = world.boxes[sandbox.id]
        async with asyncio.timeout(2):
            with pytest.raises(ProviderError):
                await sandbox.exec(
                    argv, stdin=None, env={}, workdir=None, timeout_s=30, output=OutputSink(1024)
                )
        await asyncio.sleep(0)  # the ended task's callback
        assert not box.commands


async def test_a_relays_own_world_forgets_its_oldest_ended_sandboxes(tmp_path: Path) -> None:
    """A relay built with the memory provider made a world that kept every sandbox it ever
    ran: memory and the collector's every full pass grew with each run served. Its world
    remembers the last HISTORY ended ones (a test's world still keeps them all); live
    sandboxes are never forgotten, nor is a run's command ledger cut below that."""
    assert MemoryProvider(make_settings(tmp_path, cluster="test")).world.history == HISTORY
    assert MemoryWorld().history is None
    world = MemoryWorld(history=3)
    provider = MemoryProvider(make_settings(tmp_path, cluster="test"), world)
    spec = SandboxSpec(run_id="run_many", cluster="test", timeout_s=30, grace_s=10, image="none")
    async with provider.sandbox(spec) as live:
        ids = []
        for _ in range(10):
            async with provider.sandbox(spec) as sandbox:
                await sandbox.exec(
                    ["true"], stdin=None, env={}, workdir=None, timeout_s=30, output=OutputSink(64)
                )
                ids.append(sandbox.id)
        assert list(world.boxes) == [live.id, *ids[-3:]]
        assert 3 <= len(world.started) <= 6 and world.started[-1][0] == ids[-1]
        assert len(world.lifetimes) == 1 and live.id in world.lifetimes  # the live one's
    assert set(world.boxes) == {live.id, *ids[-2:]}  # it ended too: the oldest went
