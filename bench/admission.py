"""Benchmark (5): what admitting a run costs as a token's runs of the day grow.

A SQLite store (a real file) is filled with ``day_runs`` ended runs of one token, all of
today; then runs are admitted one at a time through :meth:`relay.store.database.Store.admit_run`,
as the service admits them, under three sets of limits: none, ``runs_per_day`` and
``usd_per_day`` (both high enough never to refuse). The baseline is the admission without
a daily limit, measured in the same store: the ratio says what a daily limit adds, and
whether it grows with the day.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Table

from relay.store.database import Store
from relay.store.limits import Admission, day_start
from relay.store.schema import runs
from testing.rows import run_row


def _insert(table: Table, rows: list[dict[str, Any]], conn: Connection) -> None:
    conn.execute(table.insert(), rows)


LIMITS = ("none", "runs_per_day", "usd_per_day")


@dataclass
class AdmissionCost:
    day_runs: int
    limit: str
    samples: list[float]  # ms per admission

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples)


def run(day_runs: tuple[int, ...], admissions: int) -> list[AdmissionCost]:
    return asyncio.run(_run(day_runs, admissions))


async def _run(day_runs: tuple[int, ...], admissions: int) -> list[AdmissionCost]:
    out: list[AdmissionCost] = []
    for count in day_runs:
        with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
            store = await Store.open(f"sqlite:///{Path(folder) / 'relay.db'}")
            try:
                await _fill(store, count)
                out += await _measure(store, count, admissions)
            finally:
                await store.close()
    return out


async def _fill(store: Store, count: int) -> None:
    now = time.time()
    start = day_start(now)
    for first in range(0, count, 10_000):
        batch = [
            run_row(
                f"run_{i:020x}",
                state="succeeded",
                created_at=start + (now - start) * i / count,  # spread over today so far
                cost_usd=0.001,
                reserved_usd=0.01,
            ).columns()
            for i in range(first, min(first + 10_000, count))
        ]
        await store.write(partial(_insert, runs, batch))


async def _measure(store: Store, count: int, admissions: int) -> list[AdmissionCost]:
    results = {limit: AdmissionCost(count, limit, []) for limit in LIMITS}
    for n in range(admissions):
        for limit in LIMITS:  # interleaved, so drift hits the three alike
            now = time.time()
            admission = Admission(
                token_concurrent=None,
                global_concurrent=None,
                runs_per_day=10**9 if limit == "runs_per_day" else None,
                usd_per_day=1e9 if limit == "usd_per_day" else None,
                now=now,
            )
            row = run_row(f"run_new_{limit}_{n}", state="starting", created_at=now)
            started = time.perf_counter()
            await store.admit_run(row, admission)
            results[limit].samples.append((time.perf_counter() - started) * 1000)
    return list(results.values())
