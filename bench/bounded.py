"""Benchmarks of issue 19, bounded under load: a listing over runs with large output, and
the SQLite file as runs accumulate and are pruned.

- **Listing**: a real relay whose store holds ``runs`` runs of one token, each with
  1 MiB of stdout and 1 MiB of stderr (written through the store, not run); then
  ``GET /v1/runs?limit=200`` ``requests`` times, one at a time. Latency per request, and
  the relay's peak RSS (``VmHWM``) against its RSS before the first listing.
- **SQLite file size**: a new store (``auto_vacuum=INCREMENTAL``, as the relay makes it)
  filled with ``runs`` ended runs, each with ``output_bytes`` of stdout, all older than
  the retention; the file's size after a checkpoint, then after ``relay.store.retention.prune``
  deleted them all (and after the checkpoint that truncates the file).
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

import httpx
from sqlalchemy import Connection, Table

from bench import servers
from relay.store import retention
from relay.store.database import Store
from relay.store.schema import runs as runs_table
from testing.rows import run_row


def _insert(table: Table, rows: list[dict[str, Any]], conn: Connection) -> None:
    conn.execute(table.insert(), rows)


MIB = 1 << 20
OLD_DAYS = 40


@dataclass(frozen=True)
class ListingResult:
    runs: int
    requests: int
    samples_ms: list[float]
    answer_bytes: int
    rss_before_mb: float
    rss_peak_mb: float

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)


@dataclass(frozen=True)
class FileSizeResult:
    runs: int
    output_bytes: int
    filled_mb: float
    pruned_mb: float
    prune_s: float
    pruned_runs: int


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _write_big_runs(url: str, count: int) -> None:
    store = await Store.open(url)
    try:
        output = "x" * MIB
        for number in range(count):
            row = run_row(
                f"run_big{number:05}",
                token="bench",
                state="succeeded",
                stdout=output,
                stderr=output,
                created_at=time.time() - number,
            )
            await store.admit_run(row)
    finally:
        await store.close()


def listing(root: Path, *, runs: int, requests: int) -> ListingResult:
    with servers.relay(root / "listing") as (relay, token):
        assert relay.process is not None
        relay.stop()  # fill its store while it is down, then start it again
        asyncio.run(_write_big_runs(relay.env["RELAY_DATABASE_URL"], runs))
        relay.start(timeout_s=30)
        assert relay.process is not None
        pid = relay.process.pid
        headers = {"Authorization": f"Bearer {token}"}
        url = relay.url + "/v1/runs"
        before = _status_mb(pid, "VmRSS")
        samples = []
        size = 0
        with httpx.Client(timeout=60) as client:
            for _ in range(requests):
                started = time.perf_counter()
                answer = client.get(url, params={"limit": 200}, headers=headers)
                samples.append((time.perf_counter() - started) * 1000)
                answer.raise_for_status()
                size = len(answer.content)
        return ListingResult(runs, requests, samples, size, before, _status_mb(pid, "VmHWM"))


async def _file_size(path: Path, runs: int, output_bytes: int) -> FileSizeResult:
    url = f"sqlite:///{path}"
    store = await Store.open(url)
    try:
        old = time.time() - OLD_DAYS * 86_400
        output = "y" * output_bytes
        for first in range(0, runs, 1000):
            batch = [
                run_row(
                    f"run_{i:08}", state="succeeded", created_at=old + i, stdout=output
                ).columns()
                for i in range(first, min(first + 1000, runs))
            ]
            await store.write(partial(_insert, runs_table, batch))
    finally:
        await store.close()  # its last checkpoint truncates the WAL: the file holds it all
    filled = path.stat().st_size
    store = await Store.open(url)
    try:
        started = time.perf_counter()
        pruned = await retention.prune(store, retention.cutoff(30))
        seconds = time.perf_counter() - started
    finally:
        await store.close()
    return FileSizeResult(
        runs, output_bytes, filled / MIB, path.stat().st_size / MIB, seconds, pruned.runs
    )


def file_size(*, runs: int, output_bytes: int) -> FileSizeResult:
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
        return asyncio.run(_file_size(Path(folder) / "relay.db", runs, output_bytes))
