"""Benchmark (5): warm pools, time from a run's submit to its first output byte, pooled vs cold.

``python -m bench.pools`` (part of ``make bench``; ``--smoke`` for tiny samples) writes its
section of bench/RESULTS.md. In process, through the run service (no HTTP: the relay's HTTP
cost is benchmark (1)'s): a submit is timed to the first ``output`` event of its run.

- **memory**: the memory provider with a fixed 500 ms create (``create_delay_s``), one job
  with ``warm = 4`` and a twin with no pool, runs arriving one at a time below the refill
  rate, interleaved pooled / cold (each first in every other round); then a burst of 3x the
  pool at once.
- **local**: the same on bubblewrap (``warm = 2``), where a create is the real one. Local's
  create costs less than a pool's claim, so the relay skips its pools (issue 42): its
  "pooled" job's runs take the cold path, and its rows read pooled = cold.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relay.auth import Principal, new_token
from relay.providers.contract import Provider
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.provider import LocalProvider
from relay.providers.memory import MemoryFaults, MemoryProvider, MemoryWorld
from relay.runs.event_bus import RunEvent
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.runtime import Relay
from relay.settings import Settings

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## (5) Warm pools: submit to first output byte, pooled vs cold"
PRINCIPAL = Principal(name="bench", command=False)
JOB = 'command = ["echo", "ready"]\ntimeout_s = 10\nwarm = {warm}\n{extra}'


@dataclass
class Row:
    provider: str
    case: str
    times_ms: list[float]
    pooled: int

    def cells(self) -> str:
        ordered = sorted(self.times_ms)
        if not ordered:  # a burst's pooled ones where the provider keeps no pool (local)
            return f"| {self.provider} | {self.case} | 0 | 0 | n/a | n/a |"
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return (
            f"| {self.provider} | {self.case} | {len(ordered)} | {self.pooled} | "
            f"{statistics.median(ordered):.1f} | {p99:.1f} |"
        )


def _settings(root: Path, provider: str, warm: int) -> Settings:
    jobs = root / "jobs"
    extra = f'provider = "{provider}"\n'
    for name, size in (("pooled", warm), ("cold", 0)):
        (jobs / name).mkdir(parents=True)
        (jobs / name / "job.toml").write_text(JOB.format(warm=size, extra=extra))
    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        jobs_dir=jobs,
        tokens_file=root / "tokens.toml",
        database_url=f"sqlite:///{root / 'relay.db'}",
        local_root=root / "sandboxes",
        providers=[provider],
        cluster="bench",
        grace_s=5,
        pool_idle_s=120,
    )


async def first_output(
    service: RunService, job: str, principal: Principal = PRINCIPAL
) -> tuple[float, bool]:
    """Milliseconds from submit to the run's first output event; whether it was pooled."""
    seen = asyncio.Event()
    run_ids: set[str] = set()

    def on_event(event: RunEvent) -> None:
        if event.kind == "output" and event.run_id in run_ids:
            seen.set()

    unsubscribe = service.events.subscribe(on_event)
    started = time.perf_counter()
    try:
        run, _ = await service.submit(principal, RunRequest(job=job), None)
        run_ids.add(run.id)
        await asyncio.wait_for(seen.wait(), 30)
        elapsed = (time.perf_counter() - started) * 1000
    finally:
        unsubscribe()
    done = await service.wait(run.id, 30)
    return elapsed, '"pooled": true' in done.timings


async def _measure(
    provider_name: str, make: Callable[[Settings], Provider], warm: int, rounds: int, gap_s: float
) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="relay-bench-pools-") as folder:
        settings = _settings(Path(folder), provider_name, warm)
        new_token(settings.tokens_file, "bench")  # the relay reads its token file
        async with Relay.open(settings, providers={provider_name: make(settings)}) as relay:
            await relay.start()
            service = relay.service
            await _filled(service)
            rows = {case: Row(provider_name, case, [], 0) for case in ("pooled", "cold")}
            for round_number in range(rounds):
                # Each goes first in every other round: the run after the gap and the one
                # right behind another are not alike (a loaded machine's scheduler, a
                # terminate still going on beside serving).
                order = ("pooled", "cold") if round_number % 2 == 0 else ("cold", "pooled")
                for case in order:
                    elapsed, pooled = await first_output(service, case)
                    rows[case].times_ms.append(elapsed)
                    rows[case].pooled += pooled
                    await asyncio.sleep(gap_s)  # arrivals below the refill rate
            await _filled(service)
            burst = await asyncio.gather(
                *(first_output(service, "pooled") for _ in range(3 * warm))
            )
            for kind, wanted in (("pooled", True), ("cold", False)):
                rows[f"burst {kind}"] = Row(
                    provider_name,
                    f"burst of {3 * warm} (pool of {warm}), the {kind} ones",
                    [elapsed for elapsed, pooled in burst if pooled is wanted],
                    sum(pooled for _, pooled in burst if pooled is wanted),
                )
    return list(rows.values())


async def _filled(service: RunService) -> None:
    """Wait until the pool is full: ``pools.size`` is 0 where the provider skips pools."""
    while service.pools.ready < service.pools.size:
        await asyncio.sleep(0.05)


def _memory(settings: Settings) -> Provider:
    world = MemoryWorld(faults=MemoryFaults(create_delay_s=0.5))
    return MemoryProvider(settings, world)


async def _all(rounds: int) -> list[Row]:
    rows = await _measure("memory", _memory, 4, rounds, 0.2)
    if bwrap_works():
        rows += await _measure("local", LocalProvider, 2, rounds, 0.3)
    return rows


def render(rows: list[Row], seconds: float) -> str:
    lines = [
        HEADING,
        "",
        "In process (`python -m bench.pools`, "
        f"{seconds:.0f} s): milliseconds from `RunService.submit` to the run's first output "
        "event. memory: a fixed 500 ms create, `warm = 4`; local: bubblewrap, `warm = 2`. "
        "Pooled and cold runs interleaved (each first in every other round), arriving below "
        "the refill rate; then a burst of 3x "
        "the pool at once (the runs past the pool take the cold path). A local sandbox's "
        "create is a folder and a cgroup (its process starts with the command), cheaper than "
        "a pool's claim, so the relay skips local's pools (issue 42): its `warm = 2` job "
        "keeps no sandbox and its runs are cold (pooled 0), the same path as the cold job's. "
        "Pools are for providers whose create is the wait.",
        "",
        "| provider | case | runs | pooled | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
        *(row.cells() for row in rows),
        "",
    ]
    ratios = []
    for provider in dict.fromkeys(row.provider for row in rows):
        pooled_row, cold_row = (
            row for row in rows if row.provider == provider and row.case in ("pooled", "cold")
        )
        pooled, cold = statistics.median(pooled_row.times_ms), statistics.median(cold_row.times_ms)
        skipped = "" if pooled_row.pooled else " (its pool skipped: both cold)"
        ratios.append(f"{provider}: pooled p50 = {pooled / cold:.3f}x cold p50{skipped}")
    lines += [
        "Targets: pooled p50 ≤ 0.15x cold p50 (memory, 500 ms create); a pool never makes a "
        "run slower (local: no pool, issue 42). " + "; ".join(ratios) + ".",
        "",
    ]
    return "\n".join(lines) + "\n"  # a blank line before the next section


def write(section: str, path: Path = RESULTS, heading: str = HEADING) -> None:
    """Put ``section`` in place of the benchmark's section of ``path`` that starts with
    ``heading`` (this one's by default), or at its end."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(heading) + r".*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pools", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny samples, a few seconds")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = asyncio.run(_all(3 if args.smoke else 30))
    section = render(rows, time.monotonic() - started)
    print(section)
    if args.write and not args.smoke:
        write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
