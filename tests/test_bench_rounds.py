"""Issue 42's overhead ratio in ``python -m bench``: rounds in alternating order, and the
median of each round's relay-to-floor ratio (bench/rounds.py, bench/report.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bench.load import LoadResult
from bench.report import PLAIN_FLOOR, Results, render, targets
from bench.rounds import (
    combine,
    pinned,
    round_order,
    round_ratios,
    round_seconds,
    usable_cpus,
)


def _row(cpu_ms: float, *, concurrency: int = 10, requests: int = 1000) -> LoadResult:
    return LoadResult(
        concurrency=concurrency,
        requests=requests,
        seconds=2.0,
        errors=0,
        p50_ms=cpu_ms * concurrency,
        p90_ms=cpu_ms * concurrency * 1.5,
        p99_ms=cpu_ms * concurrency * 2,
        max_ms=cpu_ms * concurrency * 3,
        server_cpu_ms=cpu_ms,
        sent=requests + concurrency,
    )


def _results(relay_ms: list[float], floor_ms: list[float]) -> Results:
    """The same rounds at c=10 and c=50, recorded as ``python -m bench`` records them."""
    results = Results(command="python -m bench", smoke=False)
    for name, cpus in (("relay (SQLite)", relay_ms), ("floor (SQLite)", floor_ms)):
        for level in (10, 50):
            rows = [_row(cpu, concurrency=level) for cpu in cpus]
            results.overhead.setdefault(name, []).append(combine(rows))
            results.overhead_rounds.setdefault(name, {})[level] = rows
    return results


def _floor_target(results: Results) -> tuple[str, bool]:
    found = [
        (measured, ok)
        for name, measured, ok in targets(results)
        if name == "(1) relay CPU per run ≤ 2.0x the stack's floor (SQLite)"
    ]
    assert len(found) == 1, targets(results)
    return found[0]


def test_the_relay_and_its_floor_swap_places_every_round() -> None:
    names = ["baseline", "relay (SQLite)", "floor (SQLite)", PLAIN_FLOOR]
    orders = [round_order(names, index) for index in range(4)]
    assert orders[0] == names and orders[2] == names
    assert orders[1] == orders[3] == list(reversed(names))
    sequence = [name for order in orders for name in order if name.endswith("(SQLite)")]
    assert sequence[:4] == ["relay (SQLite)", "floor (SQLite)", "floor (SQLite)", "relay (SQLite)"]


def test_the_floor_target_reads_the_median_of_each_rounds_ratio_not_one_point() -> None:
    # The machine slowed in the last two rounds, and the floor's first two rounds got a
    # burst the relay's did not: each round's ratio is ~1.94-2.0 but one (3.0); the medians
    # of each side's rounds, one point each, read 0.77 / 0.32 = 2.41.
    results = _results(relay_ms=[0.60, 0.64, 0.90, 0.94], floor_ms=[0.31, 0.33, 0.30, 0.47])
    relay, floor = results.overhead["relay (SQLite)"][0], results.overhead["floor (SQLite)"][0]
    assert relay.server_cpu_ms / floor.server_cpu_ms == pytest.approx(2.41, abs=0.01)
    measured, met = _floor_target(results)
    assert met, measured
    assert measured.startswith("c=10: 1.97x (median of 4 rounds, 1.94-3.00x; 0.77 vs 0.32 ms)")


def test_a_median_ratio_over_two_is_reported_as_missed() -> None:
    results = _results(relay_ms=[0.70, 0.72, 0.66], floor_ms=[0.33, 0.34, 0.34])
    measured, met = _floor_target(results)
    assert not met
    assert measured.startswith("c=10: 2.12x (median of 3 rounds, 1.94-2.12x;"), measured


def test_the_rounds_table_lists_each_rounds_ratio_beside_the_median() -> None:
    text = render(_results(relay_ms=[0.60, 0.64, 0.90], floor_ms=[0.30, 0.30, 0.50]))
    assert "| SQLite | floor | 50 | 2.00x, 2.13x, 1.80x | 2.00x |" in text


def test_a_combined_row_sums_the_rounds_and_takes_the_median_cpu() -> None:
    row = combine([_row(0.5), _row(0.9, requests=500), _row(0.6)])
    assert (row.requests, row.sent, row.seconds, row.errors) == (2500, 2530, 6.0, 0)
    assert row.server_cpu_ms == 0.6 and row.p50_ms == 6.0 and row.max_ms == 27.0


def test_rounds_that_do_not_pair_are_refused() -> None:
    with pytest.raises(ValueError, match="do not pair"):
        round_ratios([_row(0.6)], [_row(0.3), _row(0.3)])


def test_the_seconds_are_split_among_the_rounds_in_whole_seconds() -> None:
    assert [round_seconds(8, 4), round_seconds(3, 4), round_seconds(2, 2)] == [2, 1, 1]


def test_pinning_puts_every_server_thread_on_the_first_cpu_and_gives_them_all_back() -> None:
    cpus = usable_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to pin apart")
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        process = psutil.Process(server.pid)
        while process.num_threads() < 2:
            time.sleep(0.01)
        with pinned([server.pid], enabled=True) as wrk_cpus:
            assert wrk_cpus == cpus[1:]
            assert {frozenset(os.sched_getaffinity(t.id)) for t in process.threads()} == {
                frozenset(cpus[:1])
            }
        assert {frozenset(os.sched_getaffinity(t.id)) for t in process.threads()} == {
            frozenset(cpus)
        }
        with pinned([server.pid], enabled=False) as wrk_cpus:
            assert wrk_cpus is None
    finally:
        server.kill()
        server.wait()
