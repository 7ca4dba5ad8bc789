"""A zero-latency, in-process provider used only by the benchmarks (``RELAY_PROVIDERS=bench``).

It follows :class:`relay.providers.base.Provider` without doing any work, so a run on it
costs exactly what the relay itself costs: auth, validation, admission, the store writes
and the answer. ``exec`` returns at once with a fixed output, except for the argv
``["sleep", N]``, which waits N seconds without using a process or a thread (the
"waiting callers" benchmark holds a thousand of these).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import ClassVar

from relay.providers.base import ExecResult, OutputSink, SandboxRef, SandboxSpec
from relay.settings import Settings

OUTPUT = b"ok\n"


class BenchSandbox:
    """A sandbox that exists only as an id."""

    def __init__(self, sandbox_id: str) -> None:
        self.id = sandbox_id

    async def upload(self, files: Mapping[str, bytes]) -> None:
        return None

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
        if len(argv) == 2 and argv[0] == "sleep":
            await asyncio.sleep(float(argv[1]))
        output.write("stdout", OUTPUT)
        return ExecResult(exit_code=0)


class BenchProvider:
    """Sandboxes that cost nothing; tracked so the reaper sees what a real provider shows."""

    name: ClassVar[str] = "bench"

    def __init__(self, settings: Settings) -> None:
        self.cluster = settings.cluster
        self._live: dict[str, str] = {}

    def check(self, spec: SandboxSpec) -> None:
        return None

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[BenchSandbox]:
        box = BenchSandbox(f"bench-{secrets.token_hex(6)}")
        self._live[box.id] = spec.run_id
        try:
            yield box
        finally:
            await self.terminate(box.id)

    async def list_owned(self) -> list[SandboxRef]:
        return [SandboxRef(sandbox_id, run_id) for sandbox_id, run_id in self._live.items()]

    async def terminate(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)

    async def aclose(self) -> None:
        self._live.clear()
