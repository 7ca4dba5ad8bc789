"""bench/RESULTS.md: the machine, the figures, the ratios, the targets and the command."""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import dataclass, field
from importlib.metadata import version

from bench.admission import AdmissionCost
from bench.bounded import FileSizeResult, ListingResult
from bench.load import LoadResult
from bench.local import Timing
from bench.rounds import RoundRatios, round_ratios
from bench.waiting import WaitingResult


@dataclass
class Results:
    """Everything one ``python -m bench`` run measured."""

    command: str
    smoke: bool
    machine: str = ""
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    overhead: dict[str, list[LoadResult]] = field(default_factory=dict)
    """(1) one row per target and concurrency: its rounds combined (bench/rounds.py)."""
    overhead_rounds: dict[str, dict[int, list[LoadResult]]] = field(default_factory=dict)
    """(1) each target's rounds at each concurrency, in the order measured."""
    pinned: bool = False
    """(1) the servers on one CPU and wrk on the others."""
    postgres_note: str = ""
    waiting: dict[str, WaitingResult] = field(default_factory=dict)
    local: list[Timing] = field(default_factory=list)
    local_note: str = ""
    admission: list[AdmissionCost] = field(default_factory=list)
    listing: ListingResult | None = None
    file_size: FileSizeResult | None = None
    seconds: float = 0.0


def machine_line() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    wrk_version = (wrk.stdout or wrk.stderr).split(" [")[0].removeprefix("wrk ").strip()
    packages = ", ".join(
        f"{name} {version(name)}"
        for name in ("uvicorn", "uvloop", "httptools", "starlette", "sqlalchemy", "asyncpg")
    )
    return (
        f"{model}, {os.cpu_count()} cores, {memory_gib:.0f} GiB RAM; Linux {platform.release()}; "
        f"Python {platform.python_version()}; {packages}; wrk {wrk_version}"
    )


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base and not math.isnan(value) else "—"


def _loads(values: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


FLOOR_RATIO_TARGET = 2.0
"""Issue 42: the relay's server CPU per run over the floor's, at c=10 and c=50 (issue 24's
1.5x was withdrawn)."""


PLAIN_FLOOR = "floor on uvicorn's defaults"
"""The floor served on uvicorn's defaults (two sends an answer, Python's collector setting), as
it was before issue 42's third pass served it as the relay serves any app: a row beside the
floor, so the ratio is readable against both (bench/floor.py)."""


def floor_ratios(results: Results, store: str, *, floor: str = "floor") -> dict[int, RoundRatios]:
    """Issue 42's figure at c=10 and c=50: the relay's server CPU per request over the
    floor's, round by round (each round measures both back to back), on ``store``."""
    relay = results.overhead_rounds.get(f"relay ({store})", {})
    base = results.overhead_rounds.get(f"{floor} ({store})", {})
    return {
        level: round_ratios(relay[level], base[level])
        for level in (10, 50)
        if level in relay and level in base
    }


def targets(results: Results) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for each target the issue sets."""
    out: list[tuple[str, str, bool]] = []
    by_level = {name: {r.concurrency: r for r in rows} for name, rows in results.overhead.items()}
    base, sqlite = by_level.get("baseline", {}), by_level.get("relay (SQLite)", {})
    floor = by_level.get("floor (SQLite)", {})
    top = max(sqlite) if sqlite else None
    if top is not None and top in base:
        share = sqlite[top].per_second / base[top].per_second
        measured = f"{share:.1%} ({sqlite[top].per_second:.0f} vs {base[top].per_second:.0f}/s)"
        if top in floor:  # what the stack alone reaches: see bench/floor.py
            measured += f"; the stack's floor: {floor[top].per_second / base[top].per_second:.1%}"
        out.append(
            (
                f"(1) runs/s at concurrency {top} ≥ 25% of the bare endpoint's (SQLite)",
                measured,
                share >= 0.25 and sqlite[top].errors == 0,
            )
        )
    if 10 in sqlite and 10 in base:
        extra = sqlite[10].p99_ms - base[10].p99_ms
        out.append(("(1) p99 overhead at concurrency 10 < 10 ms", f"{_ms(extra)} ms", extra < 10))
    for store in ("SQLite", "PostgreSQL"):
        ratios = floor_ratios(results, store)
        if not ratios:  # issue 42's per-run extras: what the relay adds to the stack's own floor
            continue
        relay = by_level[f"relay ({store})"]
        its_floor = by_level[f"floor ({store})"]
        measured = "; ".join(
            f"c={level}: {ratio.median:.2f}x (median of {ratio.describe()}; "
            f"{relay[level].server_cpu_ms:.2f} vs {its_floor[level].server_cpu_ms:.2f} ms)"
            for level, ratio in ratios.items()
        )
        plain = floor_ratios(results, store, floor=PLAIN_FLOOR)
        if plain.keys() == ratios.keys():  # the floor as it was served before
            measured += "; against the floor on uvicorn's defaults: " + ", ".join(
                f"{ratio.median:.2f}x" for ratio in plain.values()
            )
        out.append(
            (
                f"(1) relay CPU per run ≤ {FLOOR_RATIO_TARGET}x the stack's floor ({store})",
                measured,
                max(ratio.median for ratio in ratios.values()) <= FLOOR_RATIO_TARGET,
            )
        )
    relay_wait = results.waiting.get("relay")
    if relay_wait is not None:
        out.append(
            (
                f"(2) {relay_wait.callers} waiting runs: < 250 MB RSS, zero errors",
                f"{relay_wait.rss_peak_mb:.0f} MB peak, {relay_wait.errors} errors",
                relay_wait.rss_peak_mb < 250 and relay_wait.errors == 0,
            )
        )
    local = {t.name: t for t in results.local}
    if "relay" in local and "direct" in local:
        ratio = local["relay"].p50_ms / local["direct"].p50_ms
        out.append(
            ("(3) echo over HTTP within 1.5x of direct bwrap (p50)", f"{ratio:.2f}x", ratio <= 1.5)
        )
    return out


def render(results: Results) -> str:
    lines = [
        "# Benchmark results",
        "",
        "The relay's own cost, each figure against a baseline measured in the same run "
        "(see bench/README.md for what each benchmark does).",
        "",
        f"- Machine: {results.machine}",
        f"- Load average (1, 5, 15 min) before: {_loads(results.load_before)};"
        f" after: {_loads(results.load_after)} (other work on the machine blurs the figures)",
        f"- Command: `{results.command}` ({results.seconds:.0f} s)"
        + (" — **smoke mode: tiny samples, not figures to quote**" if results.smoke else ""),
        "",
        "## Targets",
        "",
        "| target | measured | |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {measured} | {_mark(ok)} |" for name, measured, ok in targets(results)]
    lines += [
        "",
        "## (1) Overhead per run: `POST /v1/runs` (`wait: true`, memory provider) "
        "vs a bare endpoint",
        "",
        "wrk, one thread, closed loop on loopback; every request a new run. Latency in ms. "
        "Server CPU per request is the server process's user + system time over the run, "
        "read once it is idle again, divided by the requests wrk sent (the answered ones and "
        "those in flight when it stopped, which the server serves too): it moves less than "
        "throughput with what else the machine is doing, but it moves (bench/README.md). "
        "Each short round measures every level of every target, the levels' order "
        "rotated and the targets' flipped each round (a server's levels read in the same "
        "rounds, seconds apart); a row sums its rounds' requests, time and "
        "errors, and gives the median of their percentiles and of their CPU per request "
        "(max: the largest). "
        + (
            "The servers ran on one CPU and wrk on the others."
            if results.pinned
            else "The servers and wrk shared every CPU."
        ),
        "",
        "| server | concurrency | requests | per second | ratio | p50 | p90 | p99 | max | errors "
        "| server CPU per request |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r.concurrency: r for r in results.overhead.get("baseline", [])}
    for name, rows in results.overhead.items():
        for row in rows:
            ref = base.get(row.concurrency)
            ratio = _ratio(row.per_second, ref.per_second) if ref and name != "baseline" else ""
            lines.append(
                f"| {name} | {row.concurrency} | {row.requests} | {row.per_second:.0f} | {ratio} "
                f"| {_ms(row.p50_ms)} | {_ms(row.p90_ms)} | {_ms(row.p99_ms)} | {_ms(row.max_ms)} "
                f"| {row.errors} | {row.server_cpu_ms:.2f} ms |"
            )
    lines += _round_ratios(results)
    if results.postgres_note:
        lines += ["", f"(4) PostgreSQL: {results.postgres_note}"]
    lines += [
        "",
        "## (2) Waiting callers: runs that sleep on the memory provider, all sent at once",
        "",
        "| server | callers | succeeded | errors | all held after | RSS before | RSS peak "
        "| CPU while idle-waiting | window |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in results.waiting.items():
        lines.append(
            f"| {name} | {w.callers} | {w.succeeded} | {w.errors} | {w.submit_s:.1f} s "
            f"| {w.rss_before_mb:.0f} MB | {w.rss_peak_mb:.0f} MB | {w.idle_cpu_percent:.1f}% "
            f"| {w.idle_window_s:.1f} s |"
        )
        if w.error_samples:
            lines.append(f"|  | errors seen: {'; '.join(w.error_samples)} | | | | | | | |")
    lines += [
        "",
        "## (3) Local provider: the `echo` job, one at a time",
        "",
        "| way | runs | p50 ms | p99 ms | p50 ratio to direct | p99 ratio to direct |",
        "|---|---|---|---|---|---|",
    ]
    if results.local_note:
        lines += [f"(3) {results.local_note}"]
    direct = next((t for t in results.local if t.name == "direct"), None)
    for t in results.local:
        p50_ratio = _ratio(t.p50_ms, direct.p50_ms) if direct else "—"
        p99_ratio = _ratio(t.p99_ms, direct.p99_ms) if direct else "—"
        lines.append(
            f"| {t.name} | {len(t.samples)} | {_ms(t.p50_ms)} | {_ms(t.p99_ms)} "
            f"| {p50_ratio} | {p99_ratio} |"
        )
    lines += _admission(results.admission)
    lines += bounded_section(results.listing, results.file_size)
    return "\n".join(lines) + "\n"


def _round_ratios(results: Results) -> list[str]:
    """Issue 42's ratio round by round: what the median in the targets is the median of."""
    lines = [
        "",
        "Relay CPU per request over the floor's, round by round (the two measured back to "
        "back in each round); the target reads the median.",
        "",
        "| store | floor | concurrency | each round | median |",
        "|---|---|---|---|---|",
    ]
    for store in ("SQLite", "PostgreSQL"):
        for floor in ("floor", PLAIN_FLOOR):
            for level, ratio in floor_ratios(results, store, floor=floor).items():
                each = ", ".join(f"{value:.2f}x" for value in ratio.ratios)
                lines.append(f"| {store} | {floor} | {level} | {each} | {ratio.median:.2f}x |")
    return lines + _level_ratios(results)


def _level_ratios(results: Results) -> list[str]:
    """Each server's CPU per request at c=50 over its own at c=10 in the same round (both
    levels are in every round): whether a server's CPU a run falls with concurrency, read
    without the drift between rounds."""
    paired = {
        name: round_ratios(rounds[50], rounds[10])
        for name, rounds in results.overhead_rounds.items()
        if rounds.get(10) and rounds.get(50)
    }
    if not paired:
        return []
    lines = [
        "",
        "Each server's CPU per request at concurrency 50 over its own at 10, round by round "
        "(every round measures both levels); the median.",
        "",
        "| server | each round | median |",
        "|---|---|---|",
    ]
    for name, ratio in paired.items():
        each = ", ".join(f"{value:.2f}x" for value in ratio.ratios)
        lines.append(f"| {name} | {each} | {ratio.median:.2f}x |")
    return lines


def bounded_section(listing: ListingResult | None, size: FileSizeResult | None) -> list[str]:
    """Issue 19's figures: a listing over large outputs, and the SQLite file pruned."""
    lines = [
        "",
        "## Bounded under load: listing over large outputs, SQLite file after pruning",
        "",
        "bench/bounded.py. Listing: `GET /v1/runs?limit=200` one at a time against a relay "
        "whose store holds runs with 1 MiB of stdout and 1 MiB of stderr each; peak RSS is "
        "the relay's VmHWM after the listings.",
        "",
        "| runs (1 MiB + 1 MiB) | listings | p50 ms | max ms | answer | RSS before | RSS peak |",
        "|---|---|---|---|---|---|---|",
    ]
    if listing is not None:
        lines.append(
            f"| {listing.runs} | {listing.requests} | {_ms(listing.p50_ms)} "
            f"| {_ms(listing.max_ms)} | {listing.answer_bytes / 1024:.0f} KiB "
            f"| {listing.rss_before_mb:.0f} MB | {listing.rss_peak_mb:.0f} MB |"
        )
    lines += [
        "",
        "SQLite file: a new store filled with ended runs older than the retention, then "
        "`relay.store.retention.prune` (batches off the event loop, then incremental vacuum).",
        "",
        "| runs | stdout each | file after the runs | file after pruning them | prune took |",
        "|---|---|---|---|---|",
    ]
    if size is not None:
        lines.append(
            f"| {size.runs} | {size.output_bytes} B | {size.filled_mb:.1f} MiB "
            f"| {size.pruned_mb:.2f} MiB ({size.pruned_runs} pruned) | {size.prune_s:.2f} s |"
        )
    return lines


def _admission(costs: list[AdmissionCost]) -> list[str]:
    lines = [
        "",
        "## Admission with daily limits, as a token's runs of the day grow",
        "",
        "A SQLite store for each count, filled with that many ended runs of one token today; "
        "runs admitted one at a time (`Store.admit_run`, commit included), the three kinds "
        "interleaved. The ratio is to the admission without a daily limit in the same store.",
        "",
        "| runs of the day | daily limit | admissions | median ms | ratio to none |",
        "|---|---|---|---|---|",
    ]
    plain = {c.day_runs: c.median_ms for c in costs if c.limit == "none"}
    for c in costs:
        ratio = _ratio(c.median_ms, plain[c.day_runs]) if c.day_runs in plain else "—"
        lines.append(
            f"| {c.day_runs} | {c.limit} | {len(c.samples)} | {c.median_ms:.3f} | {ratio} |"
        )
    return lines
