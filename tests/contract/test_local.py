"""The local provider under the contract suite: ground truth from /proc and its folders."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from relay.providers.local.provider import LocalProvider
from relay.providers.local.root import marked_pids
from tests.conftest import make_settings
from tests.contract.harness import Harness
from tests.contract.suite import ProviderContract, checked


@asynccontextmanager
async def open_harness(tmp_path: Path, isolation: str = "bwrap") -> AsyncIterator[Harness]:
    settings = make_settings(tmp_path, local_isolation=isolation)
    provider = LocalProvider(settings)
    root = provider.root
    known: set[str] = set()

    async def alive() -> set[str]:
        ids = {home.name for home in root.iterdir()}
        known.update(ids)
        return ids | {i for i in known if marked_pids(i)}

    async def tags_of(sandbox_id: str) -> dict[str, str]:
        data = json.loads((root / sandbox_id / "tags.json").read_text())
        return {k: v for k, v in data.items() if isinstance(v, str)}

    async def lifetime_of(sandbox_id: str) -> float | None:
        return float(json.loads((root / sandbox_id / "tags.json").read_text())["lifetime_s"])

    try:
        yield Harness(provider, alive, lifetime_of, tags_of)
    finally:
        await provider.aclose()


class TestLocal(ProviderContract):
    """The contract on local."""

    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[Harness]:
        async with checked(open_harness(tmp_path)) as opened:
            yield opened
