"""Benchmark (2): many callers waiting at once, each for a run that sleeps on the memory provider.

All requests are sent together on their own connections (``wait: true``). While they
wait, the server's RSS is sampled; its CPU is measured over the window in which every run
is running and none has finished ("idle-waiting"). The baseline is the bare endpoint
holding the same number of sleeping requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.client import post_and_close


@dataclass(frozen=True)
class WaitingResult:
    """How many callers got a finished run, and what holding them cost the server."""

    callers: int
    succeeded: int
    errors: int
    submit_s: float
    total_s: float
    rss_before_mb: float
    rss_peak_mb: float
    idle_cpu_percent: float
    idle_window_s: float
    error_samples: tuple[str, ...] = ()


def running_count(database: Path) -> Callable[[], int]:
    """Counts the relay's runs in state ``running``, read from its SQLite file (WAL)."""

    def count() -> int:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT count(*) FROM runs WHERE state = 'running'").fetchone()
        return int(row[0])

    return count


def open_connections(pid: int) -> int:
    """Established TCP connections of a process (the callers it holds)."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.status == "ESTABLISHED")


async def _sample_rss(process: psutil.Process, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _measure(
    url: str,
    body: Mapping[str, object],
    token: str | None,
    *,
    pid: int,
    callers: int,
    sleep_s: float,
    all_held: Callable[[], bool],
    expect_state: str | None,
) -> WaitingResult:
    process = psutil.Process(pid)
    rss_before = process.memory_info().rss
    peak = [float(rss_before)]
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(process, peak, stop))
    started = time.monotonic()
    tasks = [asyncio.create_task(post_and_close(url, body, token)) for _ in range(callers)]
    # The idle-waiting window: from the moment every caller is held (every run running,
    # or for the baseline every connection open) to a second before the first run ends.
    window_end = started + sleep_s - 1.0
    while time.monotonic() < window_end:
        await asyncio.sleep(0.1)
        if all_held():
            await asyncio.sleep(0.5)  # let the last answers of the burst settle
            break
    submit_s = time.monotonic() - started
    window_start = time.monotonic()
    cpu_start = _cpu_seconds(process)
    await asyncio.sleep(max(0.0, window_end - time.monotonic()))
    cpu_end = _cpu_seconds(process)
    window_s = time.monotonic() - window_start
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    total_s = time.monotonic() - started
    stop.set()
    await sampler
    succeeded, problems = 0, []
    for answer in answers:
        if isinstance(answer, BaseException):
            problems.append(type(answer).__name__)
            continue
        status, data = answer
        if status == 200 and (expect_state is None or data.get("state") == expect_state):
            succeeded += 1
        else:
            problems.append(f"{status} {data.get('state') or data.get('error')}")
    return WaitingResult(
        callers=callers,
        succeeded=succeeded,
        errors=callers - succeeded,
        submit_s=submit_s,
        total_s=total_s,
        rss_before_mb=rss_before / 2**20,
        rss_peak_mb=peak[0] / 2**20,
        idle_cpu_percent=100 * (cpu_end - cpu_start) / window_s if window_s > 0.5 else float("nan"),
        idle_window_s=window_s,
        error_samples=tuple(sorted(set(problems))[:5]),
    )


def run_relay(
    url: str, token: str, *, pid: int, database: Path, callers: int, sleep_s: float
) -> WaitingResult:
    count = running_count(database)
    return asyncio.run(
        _measure(
            url + "/v1/runs",
            {"job": "wait", "params": {"seconds": int(sleep_s)}},
            token,
            pid=pid,
            callers=callers,
            sleep_s=sleep_s,
            all_held=lambda: count() >= callers,
            expect_state="succeeded",
        )
    )


def run_baseline(url: str, *, pid: int, callers: int, sleep_s: float) -> WaitingResult:
    return asyncio.run(
        _measure(
            f"{url}/sleep/{int(sleep_s)}",
            {"job": "wait"},
            None,
            pid=pid,
            callers=callers,
            sleep_s=sleep_s,
            all_held=lambda: open_connections(pid) >= callers,
            expect_state=None,
        )
    )
