"""Issue 42's overhead ratio in ``python -m bench``: rounds in alternating order, every level
of every target in each round, and the median of each round's relay-to-floor ratio
(bench/rounds.py, bench/report.py, bench/__main__.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Collection, Mapping

import psutil
import pytest

import bench.__main__ as bench_main
from bench.load import LoadResult
from bench.report import PLAIN_FLOOR, Results, render, targets
from bench.rounds import (
    combine,
    pinned,
    round_order,
    round_plan,
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


TARGETS = {
    "baseline": ("http://baseline", None, 1),
    "relay (SQLite)": ("http://relay", "token", 2),
    "floor (SQLite)": ("http://floor", "token", 3),
    PLAIN_FLOOR: ("http://plain", "token", 4),
}
CPU_MS = {"http://baseline": 0.1, "http://relay": 0.8, "http://floor": 0.4, "http://plain": 0.35}


class DriftingMachine:
    """``run_wrk`` for ``bench.__main__._overhead`` on a machine that slows by half halfway
    through (1), whatever it measures: each server's CPU a run is the same at every level, so
    only when it is measured moves it. Records what was measured, in order."""

    def __init__(self, slows_after: int) -> None:
        self.slows_after = slows_after
        self.measured: list[tuple[str, int]] = []

    def __call__(
        self,
        url: str,
        body: Mapping[str, object],
        *,
        token: str | None,
        concurrency: int,
        seconds: float,
        server_pid: int | None = None,
        wrk_cpus: Collection[int] | None = None,
    ) -> LoadResult:
        server = url.removesuffix("/v1/runs")
        if server_pid is None:  # the warm-up, not measured
            return _row(CPU_MS[server], concurrency=concurrency)
        slower = 1.5 if len(self.measured) >= self.slows_after else 1.0
        self.measured.append((server, concurrency))
        return _row(CPU_MS[server] * slower, concurrency=concurrency)


def _overhead(
    monkeypatch: pytest.MonkeyPatch, machine: DriftingMachine, rounds: int, levels: tuple[int, ...]
) -> Results:
    monkeypatch.setattr(bench_main, "run_wrk", machine)
    args = argparse.Namespace(seconds=8.0, overhead_rounds=rounds, pin="no", levels=levels)
    results = Results(command="python -m bench", smoke=False)
    bench_main._overhead(TARGETS, args, results)
    return results


def test_every_round_measures_every_level_of_every_target_none_always_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = DriftingMachine(slows_after=10**6)
    _overhead(monkeypatch, machine, rounds=8, levels=(1, 10, 50))
    slots = len(TARGETS) * 3
    assert len(machine.measured) == 8 * slots
    each_round = [machine.measured[i : i + slots] for i in range(0, len(machine.measured), slots)]
    every = {(url, level) for url, _, _ in TARGETS.values() for level in (1, 10, 50)}
    assert all(set(measured) == every for measured in each_round)
    # Levels in blocks, rotated a place each round; in each block the targets back to back.
    assert [measured[0][1] for measured in each_round] == [1, 10, 50, 1, 10, 50, 1, 10]
    assert {measured[0][0] for measured in each_round} == {"http://baseline", "http://plain"}
    for level in (10, 50):
        pairs = [
            [url for url, at in measured if at == level and url in ("http://relay", "http://floor")]
            for measured in each_round
        ]
        assert pairs.count(["http://relay", "http://floor"]) == 4, pairs
        assert pairs.count(["http://floor", "http://relay"]) == 4, pairs


def test_a_server_whose_cpu_a_run_is_flat_reads_flat_on_a_drifting_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Level after level, the machine slowing halfway read the relay 1.2x dearer at c=50
    # than at c=10 (and the floor too): a fall or a rise with concurrency made by the clock.
    machine = DriftingMachine(slows_after=8 * len(TARGETS) * 3 // 2)
    results = _overhead(monkeypatch, machine, rounds=8, levels=(1, 10, 50))
    for name in ("relay (SQLite)", "floor (SQLite)", "baseline"):
        by_level = {row.concurrency: row.server_cpu_ms for row in results.overhead[name]}
        assert by_level[50] == pytest.approx(by_level[10]) == pytest.approx(by_level[1])
        rounds = results.overhead_rounds[name]
        assert [len(rounds[level]) for level in (1, 10, 50)] == [8, 8, 8]
    measured, met = _floor_target(results)
    assert measured.startswith("c=10: 2.00x (median of 8 rounds, 2.00-2.00x; 1.00 vs 0.50 ms)")
    assert "c=50: 2.00x (median of 8 rounds, 2.00-2.00x; 1.00 vs 0.50 ms)" in measured
    assert met


def test_with_two_levels_each_leads_every_other_round() -> None:
    names = ["relay", "floor"]
    assert [round_plan(names, (1, 10), index) for index in range(3)] == [
        [("relay", 1), ("floor", 1), ("relay", 10), ("floor", 10)],
        [("floor", 10), ("relay", 10), ("floor", 1), ("relay", 1)],
        [("relay", 1), ("floor", 1), ("relay", 10), ("floor", 10)],
    ]


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


def test_each_servers_c50_is_read_over_its_own_c10_in_the_same_round() -> None:
    results = Results(command="python -m bench", smoke=False)
    for name, c10, c50 in (
        ("relay (SQLite)", [0.60, 0.80, 0.70], [0.57, 0.80, 0.84]),
        ("floor (SQLite)", [0.30, 0.40, 0.30], [0.27, 0.30, 0.30]),
    ):
        results.overhead_rounds[name] = rounds = {
            10: [_row(cpu, concurrency=10) for cpu in c10],
            50: [_row(cpu, concurrency=50) for cpu in c50],
        }
        results.overhead[name] = [combine(rounds[10]), combine(rounds[50])]
    text = render(results)
    assert "| relay (SQLite) | 0.95x, 1.00x, 1.20x | 1.00x |" in text
    assert "| floor (SQLite) | 0.90x, 0.75x, 1.00x | 0.90x |" in text


def test_a_combined_row_sums_the_rounds_and_takes_the_median_cpu() -> None:
    row = combine([_row(0.5), _row(0.9, requests=500), _row(0.6)])
    assert (row.requests, row.sent, row.seconds, row.errors) == (2500, 2530, 6.0, 0)
    assert row.server_cpu_ms == 0.6 and row.p50_ms == 6.0 and row.max_ms == 27.0


def test_rounds_that_do_not_pair_are_refused() -> None:
    with pytest.raises(ValueError, match="do not pair"):
        round_ratios([_row(0.6)], [_row(0.3), _row(0.3)])


def test_the_seconds_are_split_among_the_rounds_in_whole_seconds() -> None:
    assert [round_seconds(8, 8), round_seconds(8, 4), round_seconds(3, 4), round_seconds(2, 2)] == [
        1,
        2,
        1,
        1,
    ]


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
