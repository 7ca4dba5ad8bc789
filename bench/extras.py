"""The relay's per-run extras over the stack's floor, in one process (issue 24).

``python -m bench.extras [--rounds N] [--runs N]`` drives the relay's ASGI app (its
middleware, routes, run service, the memory provider's ``noop`` job, a SQLite store) and the
floor's (bench/floor.py) directly, no sockets, ten runs at a time, in alternating rounds of
each, and prints the CPU each spends per run and their ratio. Alternating in one process
makes the ratio hold while the machine's speed drifts, which moves benchmark (1)'s
per-process figures by 10% between runs on a shared virtual machine. The relay's rounds are
also taken with logging at ``warning`` (the same app without its three info lines a run):
the gap is what the log lines cost. A diagnostic for profiling, not a target: benchmark (1)
measures the target, over HTTP.

Two more rows are bounds, not relays anyone should run (the issue forbids dropping what they
drop): ``bound``, the same app with no log lines and its metrics switched off (their two
methods made no-ops), and ``bare``, that and no sandbox at all (a run's steps answer success at
once: no provider, no deadlines, no exec, no terminate). What the relay does beyond the floor
in ``bare`` is its request side, the run's task and final write, and the events.

``--budget`` reads the figure tests/test_budget.py checks, as it checks it; ``--repeat N``
reads it N times in a row (issue 42, item 3: the evidence that it holds while the machine is
busy with another test run), each pass's ratio, then the largest.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench.floor as floor_server
from bench.servers import BENCH_JOBS
from relay.auth import new_token
from relay.http.app import create_app
from relay.http.metrics import Metrics
from relay.http.server import settle_heap
from relay.logs import configure
from relay.run_state import RunState
from relay.runs.run_task import RunTask
from relay.settings import Settings
from relay.store.database import Store
from relay.store.records import RunValues

App = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]
CONCURRENCY = 10
BUDGET_ROUNDS, BUDGET_RUNS = 60, 50
"""The budget test's rounds: many short ones, so that some fall between other work."""
BUDGET_ATTEMPTS = 4
"""At most this many times :data:`BUDGET_ROUNDS` while the cheapest rounds read over budget."""
BUDGET = Path(__file__).resolve().parent / "budget.toml"
BODY = json.dumps({"job": "noop", "wait": True}).encode()


class Target:
    """One app under test and the CPU it has used so far."""

    def __init__(
        self, name: str, app: App, token: str, clock: Callable[[], float] = time.process_time
    ) -> None:
        self.name, self.app, self.clock = name, app, clock
        self.cpu_s, self.runs, self.refused = 0.0, 0, 0
        self.headers = [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {token}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ]

    async def post(self) -> None:
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/runs",
            "raw_path": b"/v1/runs",
            "query_string": b"",
            "root_path": "",
            "headers": list(self.headers),
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
            "state": {},
        }
        sent = False

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.Event().wait()  # the caller never hangs up
            raise AssertionError  # pragma: no cover

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] != 200:
                self.refused += 1

        await self.app(scope, receive, send)

    async def round(self, runs: int) -> None:
        async def caller(count: int) -> None:
            for _ in range(count):
                await self.post()

        started = self.clock()
        await asyncio.gather(*(caller(runs // CONCURRENCY) for _ in range(CONCURRENCY)))
        self.cpu_s += self.clock() - started
        self.runs += runs // CONCURRENCY * CONCURRENCY


@asynccontextmanager
async def _relay(root: Path, database_url: str | None = None) -> Any:
    """The relay app with its lifespan running (on a SQLite file unless told another store)."""
    folder = root / "relay"
    jobs = folder / "jobs"
    for job, manifest in BENCH_JOBS.items():
        (jobs / job).mkdir(parents=True)
        (jobs / job / "job.toml").write_text(manifest)
    token = new_token(folder / "tokens.toml", "bench")
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        providers=["memory"],
        jobs_dir=jobs,
        tokens_file=folder / "tokens.toml",
        database_url=database_url or f"sqlite:///{folder / 'relay.db'}",
        state_dir=folder,  # with PostgreSQL it would be the working directory: the clone's
        max_concurrent=100_000,
        max_wait_s=120,
    )
    app = create_app(settings)
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    outbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})

    async def send(message: MutableMapping[str, Any]) -> None:
        await outbox.put(message)

    lifespan = asyncio.create_task(app({"type": "lifespan", "state": {}}, inbox.get, send))
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield app, token
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await lifespan


@asynccontextmanager
async def _targets(root: Path, names: tuple[str, ...]) -> AsyncIterator[list[Target]]:
    """The apps under test, each app's log lines to a file (as a relay's are when its
    stderr is a log file), in the order of ``names`` (``floor`` and the relay's rows)."""
    log_file = (root / "relay.log").open("w")
    kept = logging.getLogger().handlers[:], logging.getLogger().level
    thresholds = gc.get_threshold()
    configure("info", "json")
    for handler in logging.getLogger().handlers:
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(log_file)
    try:
        async with AsyncExitStack() as stack:
            app, relay_token = await stack.enter_async_context(_relay(root))
            token = new_token(root / "floor-tokens.toml", "bench")
            floor_server.TOKENS[hashlib.sha256(token.encode()).hexdigest()] = "bench"
            floor_server.app.state.store = store = await Store.open(
                f"sqlite:///{root / 'floor.db'}"
            )
            stack.push_async_callback(store.close)
            # As `relay serve` does once it serves (relay/http/server.py): what is loaded by
            # now lives as long as the process, out of the collector's full passes, and the
            # youngest objects are collected as seldom as there.
            settle_heap()
            yield [
                Target(name, floor_server.app, token)
                if name == "floor"
                else Target(name, app, relay_token)
                for name in names
            ]
    finally:
        logging.getLogger().handlers[:], level = kept
        logging.getLogger().setLevel(level)
        gc.set_threshold(*thresholds)
        log_file.close()


async def measure(rounds: int, runs: int) -> list[Target]:
    with tempfile.TemporaryDirectory(prefix="relay-extras-") as folder:
        names = ("floor", "relay", "quiet", "bound", "bare")
        async with _targets(Path(folder), names) as targets:
            for target in targets:  # warm up, not counted
                await _round(target, 200)
                target.cpu_s = target.runs = 0
            for _ in range(rounds):
                for target in targets:
                    await _round(target, runs)
    return targets


async def ratio_to_floor(rounds: int, runs: int) -> tuple[float, list[float], list[float]]:
    """The relay's CPU per run over the floor's, as the budget test (tests/test_budget.py)
    reads it: many short rounds of ``runs`` runs each, alternating, the CPU time of the
    event loop's thread (where both apps do all their work, their store included), and
    each app's *cheapest* round. Other work on the machine only ever adds to a round (a
    cache another process evicted, a preempted commit), so the least a round cost is the
    figure that holds still on a busy machine; the mean moves with the load. Returns the
    ratio and each app's CPU ms per run in every round."""
    with tempfile.TemporaryDirectory(prefix="relay-budget-") as folder:
        async with _targets(Path(folder), ("floor", "relay")) as (floor, relay):
            floor.clock = relay.clock = time.thread_time
            per_round: dict[str, list[float]] = {"floor": [], "relay": []}
            for target in (floor, relay):  # warm up, not counted
                await _round(target, runs)
            for _ in range(rounds):
                for target in (floor, relay):
                    target.cpu_s = target.runs = 0
                    await _round(target, runs)
                    per_round[target.name].append(target.cpu_s / target.runs * 1000)
    return min(per_round["relay"]) / min(per_round["floor"]), per_round["floor"], per_round["relay"]


def committed_budget() -> float:
    """The ratio bench/budget.toml allows (it must say why it is what it is)."""
    budget = tomllib.loads(BUDGET.read_text())
    if not str(budget.get("reason", "")).strip():
        raise ValueError(f"{BUDGET} gives no reason for its ratio")
    return float(budget["ratio"])


@dataclass(frozen=True)
class BudgetReading:
    """One pass of the budget test: the ratio of the cheapest rounds, and what it read."""

    ratio: float
    relay_ms: float
    floor_ms: float
    rounds: int
    """Rounds taken each way (more while the cheapest so far read over the budget)."""


def read_budget(allowed: float) -> BudgetReading:
    """The budget test's figure, as tests/test_budget.py reads it: :func:`ratio_to_floor`,
    and while the cheapest rounds so far are over ``allowed`` more rounds (at most
    :data:`BUDGET_ATTEMPTS` times as many), the cheapest of them all counting. Other work on
    the machine only ever makes a round dearer; a real regression is in every round."""
    import uvloop

    floor_ms: list[float] = []
    relay_ms: list[float] = []
    for _ in range(BUDGET_ATTEMPTS):
        _, floor_more, relay_more = uvloop.run(ratio_to_floor(BUDGET_ROUNDS, BUDGET_RUNS))
        floor_ms += floor_more
        relay_ms += relay_more
        if min(relay_ms) / min(floor_ms) <= allowed:
            break
    return BudgetReading(min(relay_ms) / min(floor_ms), min(relay_ms), min(floor_ms), len(relay_ms))


def repeat_budget(times: int, allowed: float) -> int:
    """Read the budget ``times`` times in a row, each pass's figure as it comes, then the
    largest; 1 when any pass was over ``allowed``."""
    ratios: list[float] = []
    for index in range(times):
        reading = read_budget(allowed)
        ratios.append(reading.ratio)
        line = (
            f"relay {reading.relay_ms:.3f} ms vs floor {reading.floor_ms:.3f} ms a run "
            f"(cheapest of {reading.rounds} rounds of {BUDGET_RUNS}): {reading.ratio:.2f}x"
        )
        if times > 1:
            verdict = "passed" if reading.ratio <= allowed else "FAILED"
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            line = f"pass {index + 1} of {times}: {line}, {verdict} (load {load})"
        print(line, flush=True)
    over = sum(ratio > allowed for ratio in ratios)
    if times > 1:
        print(
            f"{times - over} of {times} passed against bench/budget.toml's {allowed:.2f}x: "
            f"max {max(ratios):.2f}x, min {min(ratios):.2f}x"
        )
    return 1 if over else 0


async def _round(target: Target, runs: int) -> None:
    level = logging.WARNING if target.name in ("quiet", "bound", "bare") else logging.INFO
    logging.getLogger().setLevel(level)
    if target.name not in ("bound", "bare"):
        await target.round(runs)
        return
    counted, steps = (Metrics.record_run, Metrics.observe_request), RunTask.steps
    Metrics.record_run = Metrics.observe_request = _uncounted  # type: ignore[assignment]
    if target.name == "bare":
        RunTask.steps = _no_sandbox  # type: ignore[method-assign]
    try:
        await target.round(runs)
    finally:
        Metrics.record_run, Metrics.observe_request = counted  # type: ignore[method-assign]
        RunTask.steps = steps  # type: ignore[method-assign]


def _uncounted(*_: object) -> None:
    """A metric method that counts nothing (the bounds' rows)."""


async def _no_sandbox(self: RunTask) -> RunValues:
    """A run's steps with no sandbox: running at once, then succeeded (the ``bare`` row)."""
    self.run = self.run.changed(sandbox_id="none", started_at=time.time())
    return {"state": RunState.succeeded, "exit_code": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.extras", description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=1000, help="runs per app per round")
    parser.add_argument(
        "--budget",
        action="store_true",
        help="only the figure tests/test_budget.py checks (relay to floor, cheapest rounds)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --budget: read it this many times in a row, each pass's ratio and the max",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")
    if args.budget:
        return repeat_budget(args.repeat, committed_budget())
    import uvloop

    floor, relay, quiet, bound, bare = uvloop.run(measure(args.rounds, args.runs))
    print("| app | runs | CPU per run | ratio to the floor |")
    print("|---|---|---|---|")
    for target in (floor, relay, quiet, bound, bare):
        per_run = target.cpu_s / target.runs * 1000
        ratio = target.cpu_s / target.runs / (floor.cpu_s / floor.runs)
        label = {
            "floor": "floor",
            "relay": "relay",
            "quiet": "relay, log level warning",
            "bound": "relay, no log lines, no metrics (a bound, not a relay)",
            "bare": "relay, no log lines, no metrics, no sandbox (a bound)",
        }
        print(f"| {label[target.name]} | {target.runs} | {per_run:.3f} ms | {ratio:.2f}x |")
    refused = sum(target.refused for target in (floor, relay, quiet, bound, bare))
    if refused:
        print(f"{refused} runs were not answered 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
