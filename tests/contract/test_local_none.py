"""The local provider without bubblewrap (a process group): same contract, weaker walls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.contract.harness import Harness
from tests.contract.suite import ProviderContract, checked
from tests.contract.test_local import open_harness as open_local_harness


@asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with open_local_harness(tmp_path, isolation="none") as harness:
        yield harness


class TestLocalNone(ProviderContract):
    """The contract on local without bubblewrap."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
