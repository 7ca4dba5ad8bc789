"""Runs the contract suite once per provider that has a harness module."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.contract.harness import Harness

NAMES = ["local", "local_none", "e2b", "modal", "vercel"]
AVAILABLE = [n for n in NAMES if importlib.util.find_spec(f"tests.contract.harness_{n}")]


WITH_FAKES = [n for n in AVAILABLE if not n.startswith("local")]
"""Harnesses whose provider talks to a protocol fake we can inject faults into."""


@contextlib.asynccontextmanager
async def opened_harness(name: str, tmp_path: Path) -> AsyncIterator[Harness]:
    module = importlib.import_module(f"tests.contract.harness_{name}")
    async with module.open_harness(tmp_path) as opened:
        yield opened
        if opened.faults is not None:
            opened.faults.clear()  # a fault left armed must not break the fake's own shutdown
        assert await opened.alive() == set(), "a sandbox outlived its test"


@pytest.fixture(params=AVAILABLE)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    async with opened_harness(request.param, tmp_path) as opened:
        yield opened
