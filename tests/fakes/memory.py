"""An in-memory provider with a provider-side ledger, for fast fault schedules.

``MemoryWorld`` is the provider's side (it outlives any relay process); ``MemoryProvider``
is one relay process's client of it. ``crash()`` makes a client behave like a process that
died: it does nothing any more, so its sandboxes stay alive in the world until another
relay's reaper terminates them. Commands are ``["run", seconds, exit_code]``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar

from relay.errors import ProviderTimeout, ProviderUnavailable, SandboxLost
from relay.providers.base import (
    TAG_CLUSTER,
    TAG_RUN,
    ExecResult,
    OutputSink,
    SandboxRef,
    SandboxSpec,
    shielded,
)


@dataclass
class Box:
    id: str
    run_id: str
    cluster: str
    created_at: float
    lifetime_s: float
    alive: bool = True
    vanished: bool = False
    ended_at: float | None = None
    ended_by: str | None = None


@dataclass
class MemoryFaults:
    create_failures: int = 0
    create_hangs: int = 0
    """Creates that allocate, then never answer (the relay times out; the sandbox lives)."""
    allocate_then_fail: int = 0
    terminate_failures: int = 0
    vanish_next: int = 0
    cut_stream_next: int = 0
    create_delay_s: float = 0.0
    """Every create takes this long, then succeeds."""


@dataclass
class MemoryWorld:
    """The provider's own view: every sandbox ever made and how it ended."""

    boxes: dict[str, Box] = field(default_factory=dict)
    faults: MemoryFaults = field(default_factory=MemoryFaults)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def alive(self) -> set[str]:
        return {box.id for box in self.boxes.values() if box.alive}

    def allocate(self, spec: SandboxSpec) -> Box:
        box = Box(f"mem-{next(self._ids)}", spec.run_id, spec.cluster, time.time(), spec.lifetime_s)
        self.boxes[box.id] = box
        return box

    def end(self, box_id: str, by: str) -> None:
        box = self.boxes.get(box_id)
        if box is not None and box.alive:
            box.alive, box.ended_at, box.ended_by = False, time.time(), by


class MemorySandbox:
    def __init__(self, provider: MemoryProvider, box: Box) -> None:
        self.provider = provider
        self.box = box
        self.id = box.id

    async def upload(self, files: Mapping[str, bytes]) -> None:
        self._check()

    def _check(self) -> None:
        if self.box.vanished or not self.box.alive:
            raise SandboxLost("the sandbox disappeared")

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None,
        env: Mapping[str, str],
        workdir: str | None,
        timeout_s: float,
        output: OutputSink,
    ) -> ExecResult:
        self._check()
        world = self.provider.world
        seconds, code = float(argv[1]), int(argv[2])
        output.write("stdout", b"started\n")
        if world.faults.vanish_next:
            world.faults.vanish_next -= 1
            await asyncio.sleep(seconds / 2)
            self.box.vanished = True
            world.end(self.box.id, "vanished")
            raise SandboxLost("the sandbox disappeared")
        if world.faults.cut_stream_next:
            world.faults.cut_stream_next -= 1
            raise ProviderUnavailable("the output stream was cut")
        await asyncio.sleep(seconds)
        self._check()
        output.write("stdout", b"done\n")
        return ExecResult(code)


class MemoryProvider:
    """One relay process's client of a :class:`MemoryWorld`."""

    name: ClassVar[str] = "memory"

    def __init__(self, world: MemoryWorld, cluster: str, create_timeout_s: float) -> None:
        self.world = world
        self.cluster = cluster
        self.create_timeout_s = create_timeout_s
        self.dead = False

    def crash(self) -> None:
        self.dead = True

    def check(self, spec: SandboxSpec) -> None:
        return None

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[MemorySandbox]:
        faults = self.world.faults
        if faults.create_failures:
            faults.create_failures -= 1
            raise ProviderUnavailable("create failed")
        box = self.world.allocate(spec)
        if faults.create_delay_s:
            await asyncio.sleep(faults.create_delay_s)
        if faults.create_hangs:
            faults.create_hangs -= 1
            await asyncio.sleep(self.create_timeout_s)
            raise ProviderTimeout("create did not answer in time")
        if faults.allocate_then_fail:
            faults.allocate_then_fail -= 1
            raise ProviderUnavailable("create failed after allocating")
        try:
            yield MemorySandbox(self, box)
        finally:
            await shielded(self._terminate(box.id, "run"))

    async def list_owned(self) -> list[SandboxRef]:
        if self.dead:
            return []
        return [
            SandboxRef(box.id, box.run_id, created_at=datetime.fromtimestamp(box.created_at, UTC))
            for box in self.world.boxes.values()
            if box.alive and box.cluster == self.cluster
        ]

    async def _terminate(self, sandbox_id: str, by: str) -> None:
        if self.dead:
            return
        await asyncio.sleep(0)
        if self.world.faults.terminate_failures:
            self.world.faults.terminate_failures -= 1
            raise ProviderUnavailable("terminate failed")
        self.world.end(sandbox_id, by)

    async def terminate(self, sandbox_id: str) -> None:
        await self._terminate(sandbox_id, "reaper")

    async def aclose(self) -> None:
        return None

    def tags(self, sandbox_id: str) -> dict[str, str]:
        box = self.world.boxes[sandbox_id]
        return {TAG_CLUSTER: box.cluster, TAG_RUN: box.run_id}
