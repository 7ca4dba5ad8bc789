"""Benchmark (6): routing and failover (issue 36), time to first output and CPU per run.

``python -m bench.routes`` (part of ``make bench``; ``--smoke`` for tiny samples; ``--write``
updates its section of bench/RESULTS.md). In process, through the run service (no HTTP:
benchmark (1) measures that), a submit timed to its run's first ``output`` event:

- **first hangs, second 500 ms**: a job routed over ``first`` (every create hangs, given up
  at the create timeout) then ``second`` (every create takes 500 ms, the fake's
  ``create_delay_s``), against ``second`` alone (a job routed to it only), interleaved. The
  runs before ``first``'s breaker opens wait for its create timeout; once it is open they go
  straight to ``second``. Target: after, p50 ≤ 1.1x ``second`` alone.
- **CPU of a failover**: the relay's CPU per run (``time.process_time``) of runs whose first
  provider refuses every create at once (a 503; its breaker kept closed, so every run fails
  over) against runs with one provider, creates instant, in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.pools import first_output
from bench.pools import write as write_section
from relay.auth import Principal, new_token
from relay.providers.contract import Provider
from relay.providers.memory import MemoryFaults, MemoryProvider, MemoryWorld
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.runtime import Relay
from relay.settings import Settings

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## (6) Routing and failover: first output with the first provider down, CPU per failover"
PRINCIPAL = Principal(name="bench")
JOB = 'command = ["echo", "ready"]\ntimeout_s = 10\nproviders = {providers}\n'
CREATE_TIMEOUT_S = 2.0
SECOND_CREATE_S = 0.5
BREAKER_FAILURES = 3


def _settings(root: Path, **values: object) -> Settings:
    jobs = root / "jobs"
    for name, providers in (("routed", '["first", "second"]'), ("alone", '["second"]')):
        (jobs / name).mkdir(parents=True)
        (jobs / name / "job.toml").write_text(JOB.format(providers=providers))
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        jobs_dir=jobs,
        tokens_file=root / "tokens.toml",
        database_url=f"sqlite:///{root / 'relay.db'}",
        providers=["first", "second"],
        cluster="bench",
        grace_s=5,
        create_timeout_s=CREATE_TIMEOUT_S,
        **values,
    )
    new_token(settings.tokens_file, "bench")
    return settings


async def _first_output(service: RunService, job: str) -> float:
    """Milliseconds from submit to the run's first output event."""
    elapsed, _ = await first_output(service, job, PRINCIPAL)
    return elapsed


def _providers(
    settings: Settings, first: MemoryFaults, second: MemoryFaults
) -> dict[str, Provider]:
    return {
        "first": MemoryProvider(settings, MemoryWorld(faults=first)),
        "second": MemoryProvider(settings, MemoryWorld(faults=second)),
    }


async def _down_first(rounds: int) -> dict[str, list[float]]:
    """First output times: before the breaker opens, after, and the second provider alone."""
    times: dict[str, list[float]] = {"before": [], "after": [], "alone": []}
    with tempfile.TemporaryDirectory(prefix="relay-bench-routes-") as folder:
        settings = _settings(
            Path(folder), breaker_failures=BREAKER_FAILURES, breaker_cooldown_s=3600
        )
        providers = _providers(
            settings, MemoryFaults(create_hang=True), MemoryFaults(create_delay_s=SECOND_CREATE_S)
        )
        async with Relay.open(settings, providers=providers) as relay:
            await relay.start()
            service = relay.service
            for _ in range(BREAKER_FAILURES):
                times["before"].append(await _first_output(service, "routed"))
            for _ in range(rounds):
                times["after"].append(await _first_output(service, "routed"))
                times["alone"].append(await _first_output(service, "alone"))
    return times


async def _cpu_per_run(rounds: int, runs: int) -> tuple[float, float]:
    """Relay CPU milliseconds per run: with a failover (the first refuses at once), and on
    the second provider alone; alternating rounds of ``runs`` runs, ten at a time."""
    spent = {"routed": 0.0, "alone": 0.0}
    with tempfile.TemporaryDirectory(prefix="relay-bench-routes-") as folder:
        # The breaker never opens: every routed run fails over.
        settings = _settings(Path(folder), breaker_failures=10**9, breaker_failure_rate=1.0)
        providers = _providers(settings, MemoryFaults(create_status=503), MemoryFaults())
        async with Relay.open(settings, providers=providers) as relay:
            await relay.start()
            service = relay.service

            async def one(job: str) -> None:
                run, _ = await service.submit(PRINCIPAL, RunRequest(job=job), None)
                await service.wait(run.id, 30)

            for round_number in range(rounds + 1):
                for job in ("routed", "alone"):
                    began = time.process_time()
                    for _ in range(runs // 10):
                        await asyncio.gather(*(one(job) for _ in range(10)))
                    if round_number:  # the first round warms up
                        spent[job] += time.process_time() - began
    per_run = {job: seconds * 1000 / (rounds * runs) for job, seconds in spent.items()}
    return per_run["routed"], per_run["alone"]


def render(times: dict[str, list[float]], cpu: tuple[float, float], seconds: float) -> str:
    def p50(case: str) -> float:
        return statistics.median(times[case])

    routed, alone = cpu
    ratio = p50("after") / p50("alone")
    return "\n".join(
        [
            HEADING,
            "",
            f"In process (`python -m bench.routes`, {seconds:.0f} s): milliseconds from "
            "`RunService.submit` to the run's first output event. A job routed over `first` "
            f"(every create hangs; `RELAY_CREATE_TIMEOUT_S={CREATE_TIMEOUT_S:g}`) then "
            f"`second` (every create takes {SECOND_CREATE_S * 1000:.0f} ms), against a job "
            f"on `second` alone, interleaved. `RELAY_BREAKER_FAILURES={BREAKER_FAILURES}`: "
            "the first runs wait for `first`'s create timeout, then its breaker is open and "
            "runs go straight to `second`.",
            "",
            "| case | runs | p50 ms | max ms |",
            "|---|---|---|---|",
            *(
                f"| {label} | {len(times[case])} | {p50(case):.1f} | {max(times[case]):.1f} |"
                for case, label in (
                    ("before", "routed, before the breaker opens"),
                    ("after", "routed, breaker open"),
                    ("alone", "second provider alone"),
                )
            ),
            "",
            f"Target: after the breaker opens, p50 ≤ 1.1x the second provider alone: "
            f"{ratio:.3f}x. Before, each run is bounded by the create timeout "
            f"({CREATE_TIMEOUT_S * 1000:.0f} ms) plus the second's create.",
            "",
            f"Relay CPU per run, creates instant (alternating rounds): with a failover (the "
            f"first provider refuses at once) {routed:.3f} ms, one provider {alone:.3f} ms; "
            f"a failover adds {routed - alone:.3f} ms.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routes", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny samples, a few seconds")
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args(argv)
    logging.getLogger("relay").setLevel(logging.ERROR)  # each failover logs a warning
    started = time.monotonic()
    times = asyncio.run(_down_first(3 if args.smoke else 30))
    cpu = asyncio.run(_cpu_per_run(1 if args.smoke else 5, 20 if args.smoke else 200))
    section = render(times, cpu, time.monotonic() - started)
    print(section)
    if args.write and not args.smoke:
        write_section(section, heading=HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
