"""Shared fixtures: clean environment, settings in a temp folder, tokens, relay servers."""

from __future__ import annotations

import gc
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from testing.postgres import postgres_url
from testing.rigs import RIGS
from testing.settings import REPO, make_settings

__all__ = ["REPO", "database_url", "make_settings", "new_database", "postgres_url"]

SDK_VARIABLES = ("RELAY_", *(prefix for rig in RIGS.values() for prefix in rig.environment))
"""The relay's variables and those each provider's SDK reads by itself (its rig says which)."""


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect after each test, so an unclosed resource fails the test that leaked it
    rather than whichever test the garbage collector happens to run in."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees the developer's RELAY_* variables or provider credentials."""
    for name in list(os.environ):
        if name.startswith(SDK_VARIABLES):
            monkeypatch.delenv(name, raising=False)
    yield


async def new_database(server_url: str) -> str:
    """A new, empty database on the test PostgreSQL server; its SQLAlchemy URL."""
    name = "t_" + secrets.token_hex(6)
    admin = await asyncpg.connect(server_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgres"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each store test runs on a real SQLite file and on a real PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'relay.db'}"
    else:
        yield await new_database(request.getfixturevalue("postgres_url"))
