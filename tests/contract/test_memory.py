"""The shipped memory provider under the contract: its world is the ground truth."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from relay.errors import ProviderError
from relay.providers.contract import OutputSink, Provider, SandboxSpec
from relay.providers.memory import API_KEY, BODY_MARKER, MemoryProvider, MemoryWorld
from tests.conftest import make_settings
from tests.contract.fault_suite import FaultContract
from tests.contract.harness import BAD_KEY, IMPATIENT_CREATE_TIMEOUT_S, Fault, Harness, Variant
from tests.contract.suite import ProviderContract, checked


@dataclass
class WorldFaults:
    """The contract's fault injection, straight into the world's switches."""

    world: MemoryWorld
    tmp_path: Path
    secrets: tuple[str, ...] = (API_KEY, BAD_KEY, BODY_MARKER)

    def inject(self, fault: Fault, value: object) -> None:
        setattr(self.world.faults, fault, value)

    def clear(self) -> None:
        self.world.reset()

    def created(self) -> list[str]:
        return self.world.created()

    def provider(self, variant: Variant) -> Provider:
        timeout_s = IMPATIENT_CREATE_TIMEOUT_S if variant == "impatient" else 10.0
        settings = make_settings(self.tmp_path, cluster="test", create_timeout_s=timeout_s)
        if variant == "impatient":
            return MemoryProvider(settings, self.world)
        if variant == "bad_key":
            return MemoryProvider(settings, self.world, api_key=BAD_KEY)
        return MemoryProvider(settings, MemoryWorld(reachable=False))


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    world = MemoryWorld()
    provider = MemoryProvider(make_settings(tmp_path, cluster="test"), world)

    async def alive() -> set[str]:
        return world.alive()

    async def lifetime_of(sandbox_id: str) -> float | None:
        return world.boxes[sandbox_id].lifetime_s

    async def tags_of(sandbox_id: str) -> dict[str, str]:
        return dict(world.boxes[sandbox_id].tags)

    faults = WorldFaults(world, tmp_path)
    try:
        yield Harness(provider, alive, lifetime_of, tags_of, faults=faults)
    finally:
        await provider.aclose()


class TestMemory(ProviderContract, FaultContract):
    """The contract on the in-memory provider."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened


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
