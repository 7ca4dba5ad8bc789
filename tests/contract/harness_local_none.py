"""The local provider without bubblewrap (a process group): same contract, weaker walls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from tests.contract import harness_local
from tests.contract.harness import Harness


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with harness_local.open_harness(tmp_path, isolation="none") as harness:
        yield harness
