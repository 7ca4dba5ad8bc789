"""The shipped memory provider under the contract: its world is the ground truth."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from relay.providers.base import Provider
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
        yield Harness(provider, alive, lifetime_of, tags_of, faults=faults, programs=False)
    finally:
        await provider.aclose()


class TestMemory(ProviderContract, FaultContract):
    """The contract on the in-memory provider."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
