"""The store on a real SQLite file: idempotency in the database, final states kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from relay.errors import ConfigError
from relay.store import DuplicateKey, Store, meta


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'relay.db'}")
    yield opened
    await opened.close()


def row(run_id: str, key: str | None = None, **values: Any) -> dict[str, Any]:
    now = time.time()
    return {
        "id": run_id,
        "token": "t",
        "job": "echo",
        "provider": "local",
        "state": "queued",
        "idempotency_key": key,
        "request_hash": "h",
        "timeout_s": 5.0,
        "created_at": now,
        "deadline": now + 5,
        "owner": "me",
        "stdout": "",
        "stderr": "",
        "timings": "{}",
    } | values


async def test_wal_mode_and_survives_reopen(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'relay.db'}"
    first = await Store.open(url)
    await first.insert_run(row("run_a"))
    async with first.engine.connect() as conn:
        assert (await conn.execute(sa.text("PRAGMA journal_mode"))).scalar() == "wal"
    await first.close()
    second = await Store.open(url)
    assert (await second.get_run("run_a"))["state"] == "queued"  # type: ignore[index]
    await second.close()


async def test_one_run_per_token_and_key_under_a_race(store: Store) -> None:
    results = await asyncio.gather(
        *(store.insert_run(row(f"run_{i}", key="same")) for i in range(10)),
        return_exceptions=True,
    )
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, DuplicateKey) for r in results if r is not None)
    await store.insert_run(row("run_other_token", key="same", token="u"))


async def test_a_final_state_is_never_overwritten(store: Store) -> None:
    await store.insert_run(row("run_f"))
    assert await store.update_run("run_f", state="succeeded")
    assert not await store.update_run("run_f", state="lost")
    assert (await store.get_run("run_f"))["state"] == "succeeded"  # type: ignore[index]


async def test_a_newer_schema_refuses_to_start(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'relay.db'}"
    store = await Store.open(url)
    async with store.engine.begin() as conn:
        await conn.execute(meta.update().values(value="999"))
    await store.close()
    with pytest.raises(ConfigError, match="newer"):
        await Store.open(url)
