"""Retention (relay/store/retention.py) on a real SQLite file and a real PostgreSQL: old final
runs and their delivery rows go in batches, active runs and pending deliveries stay, the
daily counters stay what their triggers make them, and SQLite gives the space back."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from relay.http.metrics import Metrics
from relay.store import retention
from relay.store.database import Store
from relay.store.records import RunRecord
from relay.store.schema import deliveries, runs, token_days
from testing.relay_server import RelayProcess
from testing.rows import run_row

DAY = 86_400.0
OLD = time.time() - 40 * DAY


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    opened = await Store.open(database_url)
    yield opened
    await opened.close()


def _final(run_id: str, **values: Any) -> RunRecord:
    return run_row(run_id, state="succeeded", cost_usd=0.5, **values)


async def _deliver(store: Store, run_id: str, state: str) -> None:
    values = {
        "id": "dlv_" + run_id, "run_id": run_id, "token": "ops", "url": "https://x.test/",
        "state": state, "attempts": 1, "attempt_log": "[]", "created_at": OLD,
        "next_attempt_at": OLD,
    }  # fmt: skip
    await store.write(lambda conn: conn.execute(deliveries.insert().values(**values)))


async def _ids(store: Store, table: sa.Table) -> set[str]:
    return set(await store.read(lambda conn: conn.scalars(sa.select(table.c.id)).all()))


async def _days(store: Store) -> dict[int, tuple[int, float]]:
    def read(conn: sa.Connection) -> dict[int, tuple[int, float]]:
        rows = conn.execute(sa.select(token_days.c.day, token_days.c.runs, token_days.c.usd))
        return {int(day): (int(count), round(float(usd), 9)) for day, count, usd in rows}

    return await store.read(read)


async def test_prune_deletes_old_final_runs_only_and_keeps_the_counters(store: Store) -> None:
    for number in range(7):  # more than one batch of 3, below
        await store.admit_run(_final(f"run_old{number}", created_at=OLD + number))
    await store.admit_run(run_row("run_old_active", created_at=OLD))  # still running
    await store.admit_run(_final("run_old_pending", created_at=OLD))
    await store.admit_run(_final("run_new"))
    await _deliver(store, "run_old0", "delivered")
    await _deliver(store, "run_old_pending", "pending")  # its callback is still due
    today = int(time.time() // DAY)
    before = retention.cutoff(30)

    assert await retention.prune(store, before, dry_run=True) == retention.Pruned(7, 1)
    assert len(await _ids(store, runs)) == 10

    retention_batch = retention.BATCH
    retention.BATCH = 3
    try:
        pruned = await retention.prune(store, before)
    finally:
        retention.BATCH = retention_batch
    assert pruned == retention.Pruned(7, 1)
    assert await _ids(store, runs) == {"run_old_active", "run_old_pending", "run_new"}
    assert await _ids(store, deliveries) == {"dlv_run_old_pending"}
    days = await _days(store)
    assert days[int(OLD // DAY)] == (2, 0.5)  # the active run (reserved 0) and the pending one
    assert days[today] == (1, 0.5)
    assert await retention.prune(store, before) == retention.Pruned()


async def test_pruner_counts_rows_and_the_store_size_for_metrics(store: Store) -> None:
    for number in range(3):
        await store.admit_run(_final(f"run_old{number}", created_at=OLD))
    pruner = retention.Pruner(store, retention_days=30, interval_s=3600)
    metrics = Metrics()
    metrics.pruner = pruner
    assert (await pruner.once()).runs == 3
    text = metrics.render().decode()
    assert 'relay_pruned_rows_total{table="runs"} 3.0' in text
    shown = next(line for line in text.splitlines() if line.startswith("relay_store_bytes "))
    assert pruner.store_bytes > 0 and float(shown.split()[1]) == pruner.store_bytes


async def test_sqlite_gives_the_space_of_pruned_runs_back(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    store = await Store.open(f"sqlite:///{path}")
    try:
        output = "x" * 200_000
        for number in range(20):
            await store.admit_run(_final(f"run_{number}", created_at=OLD, stdout=output))
        full = await store.read(retention.size_bytes)
        assert full > 20 * 200_000
        assert (await retention.prune(store, retention.cutoff(30))).runs == 20
        assert await store.read(retention.size_bytes) < full / 10
    finally:
        await store.close()
    assert path.stat().st_size < full / 10  # the last checkpoint truncated the file too


@pytest.mark.slow  # needs a relay process: seconds
def test_relay_prune_converts_an_old_sqlite_file_and_the_relay_prunes(tmp_path: Path) -> None:
    path = tmp_path / "relay.db"
    with sqlite3.connect(path) as made_before:  # a file from before incremental vacuum
        made_before.execute("CREATE TABLE filler (x)")
    relay = RelayProcess(tmp_path)
    relay.add_token("ops")

    async def old_runs() -> None:
        opened = await Store.open(relay.env["RELAY_DATABASE_URL"])
        try:
            for number in range(5):
                await opened.admit_run(_final(f"run_{number}", created_at=OLD, stdout="y" * 9000))
        finally:
            await opened.close()

    asyncio.run(old_runs())
    env = {"PATH": os.environ["PATH"], **relay.env}
    command = [sys.executable, "-m", "relay", "prune", "--older-than", "50", "--dry-run"]
    counted = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert counted.stdout.startswith("would delete 0 run(s)")
    command[-3:] = ["--older-than", "35"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.startswith("deleted 5 run(s) and 0 delivery row(s)")
    assert "deleted 0 artifact content(s) no run names: 0 bytes" in done.stdout  # issue 40
    assert sqlite3.connect(path).execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    asyncio.run(old_runs())  # again, for the running relay this time
    relay.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(relay.url + "/metrics", timeout=5).text
            if 'relay_pruned_rows_total{table="runs"} 5.0' in text:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the relay did not prune")
    finally:
        relay.stop()
