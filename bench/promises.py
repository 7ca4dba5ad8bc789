"""The promises of issue 18, counted over seeded fault schedules (a sibling of bench/leaks.py).

    python -m bench.promises [SCHEDULES] [--write]

``--write`` puts the counts in bench/RESULTS.md, in their own section at its end (which
``python -m bench`` keeps when it rewrites the rest).

The schedules of testing/chaos.py (submits, cancels, provider faults, relay crashes against
the real RunService, Reaper and SQLite store, with the in-memory provider world), plus the
newer faults: the store refusing every write for a while (final writes, admissions and
heartbeats fail, then it comes back), a same-cluster sandbox the store does not know
(another relay's, young), and a shutdown with the store down (the store refuses every write
while jobs end and while the relay stops, as after a SIGTERM; a new relay on the same state
directory then starts with the store back, replaying the spool before its reaper sweeps:
issue 37). Three counts, each must be 0:

- **sandboxes leaked**: alive at the provider once the schedule has ended and been swept;
- **finished output lost**: runs whose job ended in a relay that did not crash (a relay
  stopped with the store down did not crash: its outcomes must come through the spool), whose
  final row does not carry that job's output and exit code (a DELETE that reaches a run
  between its job's end and its final write records it canceled with its output but no
  exit code: counted apart);
- **healthy runs terminated**: sandboxes the reaper ended while their run's relay was alive
  and their deadline + grace had not passed, or a foreign sandbox younger than the longest
  lifetime the relay gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from relay.errors import RelayError
from relay.providers.contract import ExecResult, SandboxSpec
from relay.providers.memory import API_KEY, MemoryFaults, MemoryProvider, MemoryWorld
from relay.runs.models import RunRequest
from relay.settings import Settings
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.chaos import PRINCIPAL, CrashableProvider, MemoryBackend, Relay, final_rows

WRITES = ("admit_run", "update_run", "finish_run", "heartbeat")


class FlakyStore:
    """The shared store, as the relays see it: while ``down``, every write fails the way a
    full disk or a restarting database does."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.down = False
        self.held = False
        """Down until cleared, whatever an outage's end says (a shutdown with the store down)."""
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if name not in WRITES:
            return attribute

        async def write(*args: Any, **kwargs: Any) -> Any:
            if self.down or self.held:
                self.refused += 1
                raise OperationalError("write", {}, Exception("database or disk is full"))
            return await attribute(*args, **kwargs)

        return write

    async def outage(self, seconds: float) -> None:
        self.down = True
        try:
            await asyncio.sleep(seconds)
        finally:
            self.down = False


@dataclass
class Ledger:
    """What the provider world saw each run's job do."""

    finished: dict[str, int | None] = field(default_factory=dict)  # run id -> its exit code


class RecordingProvider(MemoryProvider):
    """The in-memory provider, noting each job that ran to its end."""

    def __init__(self, ledger: Ledger, settings: Settings, world: MemoryWorld) -> None:
        super().__init__(settings, world)
        self.ledger = ledger

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Any]:
        async with super().sandbox(spec) as box:
            exec_once = box.exec

            async def exec(argv: Sequence[str], **options: Any) -> ExecResult:
                result: ExecResult = await exec_once(argv, **options)
                self.ledger.finished[spec.run_id] = result.exit_code
                return result

            box.exec = exec  # type: ignore[method-assign]  # wrapped, for this box only
            yield box


@dataclass
class RecordingBackend(MemoryBackend):
    ledger: Ledger = field(default_factory=Ledger)

    def new_client(self, settings: Settings) -> CrashableProvider:
        return CrashableProvider(RecordingProvider(self.ledger, settings, self.world))

    def command(self, rng: random.Random) -> list[str]:
        """A job that prints ``done`` when it finishes: its output must never be lost."""
        sleep, code = rng.uniform(0, 0.05), rng.choice([0, 0, 1])
        return ["sh", "-c", f"sleep {sleep:.3f}; echo done; exit {code}"]


async def _foreign_sandbox(world: MemoryWorld, spec: SandboxSpec) -> str:
    """A sandbox another relay of the same cluster made (the faults armed for this relay's
    creates are not its)."""
    armed, world.faults = world.faults, MemoryFaults()
    try:
        return (await world.create(API_KEY, -1, spec)).id
    finally:
        world.faults = armed


@dataclass
class Counts:
    seed: int
    runs: int = 0
    finished: int = 0
    crashes: int = 0
    outages: int = 0
    refused_writes: int = 0
    foreign: int = 0
    stops: int = 0
    spooled: int = 0
    finished_at_stop: int = 0
    leaked: list[str] = field(default_factory=list)
    output_lost: list[str] = field(default_factory=list)
    canceled_at_end: list[str] = field(default_factory=list)
    healthy_terminated: list[str] = field(default_factory=list)


async def play(seed: int, tmp: Path, steps: int = 30) -> Counts:
    """One seeded schedule; what became of every sandbox and every finished job."""
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    backend = RecordingBackend()
    real = await Store.open(f"sqlite:///{tmp / 'chaos.db'}")
    store = FlakyStore(real)
    counts = Counts(seed)
    relay = Relay(store, backend, tmp, {})  # type: ignore[arg-type]
    relays, crashed_at = [relay], {0: float("inf")}
    owner: dict[str, int] = {}
    stopped: set[int] = set()
    foreign: set[str] = set()
    outages: set[asyncio.Task[None]] = set()
    await relay.reaper.sweep()
    try:
        for _ in range(steps):
            action = rng.choices(
                [
                    "submit",
                    "cancel",
                    "fault",
                    "heal",
                    "crash",
                    "sleep",
                    "sweep",
                    "outage",
                    "foreign",
                    "stop",
                ],
                [10, 2, 3, 2, 1, 4, 2, 2, 1, 1],
            )[0]
            if action == "submit":
                request = RunRequest(
                    command=backend.command(rng),
                    timeout_s=rng.uniform(*backend.timeout_s),
                    wait=False,
                )
                with contextlib.suppress(RelayError, OperationalError):
                    row, _ = await relay.service.submit(PRINCIPAL, request, None)
                    owner[row.id] = len(relays) - 1
            elif action == "cancel" and owner:
                with contextlib.suppress(RelayError, OperationalError):
                    await relay.service.cancel(PRINCIPAL, rng.choice(sorted(owner)))
            elif action == "fault":
                backend.inject(rng)
            elif action == "heal":
                backend.heal()
            elif action == "crash":
                await relay.crash()
                crashed_at[len(relays) - 1] = time.time()
                counts.crashes += 1
                relay = Relay(store, backend, tmp, {})  # type: ignore[arg-type]
                relays.append(relay)
                crashed_at[len(relays) - 1] = float("inf")
                with contextlib.suppress(OperationalError):
                    await relay.reaper.sweep()
            elif action == "sweep":
                with contextlib.suppress(OperationalError):
                    await relay.reaper.sweep()
            elif action == "outage":
                counts.outages += 1
                outages.add(asyncio.create_task(store.outage(rng.uniform(0.01, 0.2))))
            elif action == "stop":
                # SIGTERM with the store down: jobs end meanwhile, their final writes
                # refused; the drain gives up and spools them; the next start replays.
                counts.stops += 1
                store.held = True
                await asyncio.sleep(rng.uniform(0.02, 0.08))
                await relay.service.shutdown()
                stopped.add(len(relays) - 1)
                store.held = False
                relay = Relay(store, backend, tmp, {})  # type: ignore[arg-type]
                relays.append(relay)
                crashed_at[len(relays) - 1] = float("inf")
                with contextlib.suppress(OperationalError):
                    counts.spooled += len(await relay.service.replay_spool())
                    await relay.reaper.sweep()
            elif action == "foreign":
                spec = SandboxSpec(
                    run_id=f"run_other{seed}_{len(foreign)}", cluster="test", timeout_s=600
                )
                foreign.add(await _foreign_sandbox(backend.world, spec))
            else:
                await asyncio.sleep(rng.uniform(0, 0.02))
        if outages:
            await asyncio.wait(outages)
        backend.heal()
        # Let the live relay finish its runs (final writes the outage refused retry and
        # land), then sweep until nothing of ours is left.
        tasks = set(relay.service.runner.tasks())
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for _ in range(10):
            await relay.reaper.sweep()
            if not backend.alive() - foreign:
                break
    finally:
        for old in relays:
            with contextlib.suppress(Exception):
                await old.provider.aclose()
        counts.refused_writes = store.refused
        await real.close()
    rows = await final_rows(tmp, sorted(owner))
    counts.finished_at_stop = sum(
        run_id in owner and owner[run_id] in stopped and crashed_at[owner[run_id]] == float("inf")
        for run_id in backend.ledger.finished
    )
    return _count(counts, backend, rows, owner, crashed_at, foreign)


def _count(
    counts: Counts,
    backend: RecordingBackend,
    rows: Mapping[str, RunRecord],
    owner: Mapping[str, int],
    crashed_at: Mapping[int, float],
    foreign: set[str],
) -> Counts:
    counts.runs, counts.foreign = len(rows), len(foreign)
    counts.leaked = sorted(backend.alive() - foreign)
    for run_id, code in backend.ledger.finished.items():
        if run_id not in owner or crashed_at[owner[run_id]] != float("inf"):
            continue  # a crash may lose a finished run: the reaper records it lost
        counts.finished += 1
        row = rows.get(run_id)
        if row is None or "done\n" not in (row.stdout or ""):
            counts.output_lost.append(run_id)
        elif row.exit_code != code:
            # A DELETE that landed between the job's end and its final write: the run reads
            # canceled, its output kept, its exit code not recorded. Counted apart.
            if row.state == "canceled" and row.cancel_requested:
                counts.canceled_at_end.append(run_id)
            else:
                counts.output_lost.append(run_id)
    grace = 5.0  # testing.chaos.Relay's RELAY_GRACE_S
    for box in backend.world.boxes.values():
        if box.ended_by != "reaper" or box.ended_at is None:
            continue
        if box.id in foreign:
            counts.healthy_terminated.append(box.id)
            continue
        row = rows.get(box.run_id)
        relay_alive = box.run_id in owner and crashed_at[owner[box.run_id]] > box.ended_at
        if row is None or not relay_alive or box.ended_at >= row.deadline + grace:
            continue
        if row.ended_at is None or box.ended_at < row.ended_at:
            counts.healthy_terminated.append(box.id)
    return counts


async def play_many(seeds: range, tmp: Path, parallel: int = 8) -> list[Counts]:
    results: list[Counts] = []
    for start in range(seeds.start, seeds.stop, parallel):
        batch = range(start, min(start + parallel, seeds.stop))
        results += await asyncio.gather(*(play(s, tmp / f"s{s}") for s in batch))
    return results


def summarize(results: list[Counts], seconds: float) -> str:
    def total(name: str) -> int:
        return sum(len(v) if isinstance(v := getattr(c, name), list) else v for c in results)

    return "\n".join(
        [
            f"schedules: {len(results)} (seeds 0-{len(results) - 1}), runs: {total('runs')}, "
            f"relay crashes: {total('crashes')}",
            f"store outages: {total('outages')} ({total('refused_writes')} writes refused), "
            f"foreign young sandboxes: {total('foreign')}",
            f"shutdowns with the store down: {total('stops')} "
            f"({total('spooled')} outcomes spooled and replayed; jobs finished in a relay "
            f"so stopped: {total('finished_at_stop')})",
            f"jobs finished in a relay that did not crash: {total('finished')}",
            f"sandboxes leaked: {total('leaked')}",
            f"runs whose finished output was lost: {total('output_lost')}",
            f"healthy runs terminated: {total('healthy_terminated')}",
            f"(finished jobs a DELETE reached before their final write, recorded canceled with "
            f"their output, no exit code: {total('canceled_at_end')})",
            f"wall time: {seconds:.1f} s",
        ]
    )


SECTION = "<!-- bench.promises: the section below is written by python -m bench.promises -->"


def write_section(results_md: Path, text: str, schedules: int) -> None:
    """Replace (or add) this report's section at the end of bench/RESULTS.md."""
    before = results_md.read_text().split(SECTION)[0].rstrip("\n") if results_md.exists() else ""
    section = [
        SECTION,
        "",
        "## Fault promises (issue 18): no leak, no finished output lost, no healthy run killed",
        "",
        f"`python -m bench.promises {schedules} --write` (bench/promises.py): the seeded schedules "
        "of testing/chaos.py plus store write outages, foreign young same-cluster sandboxes and "
        "shutdowns with the store down (the spool, issue 37), "
        "against the real service, reaper and SQLite store with the in-memory provider world. "
        "The three counts must be 0.",
        "",
        "```",
        text,
        "```",
        "",
    ]
    results_md.write_text(before + "\n\n" + "\n".join(section))


def main(argv: Sequence[str]) -> int:
    import logging

    write = "--write" in argv
    numbers = [a for a in argv if a != "--write"]
    schedules = int(numbers[0]) if numbers else 200
    logging.disable(logging.CRITICAL)  # injected faults log on purpose
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as folder:
            results = asyncio.run(play_many(range(schedules), Path(folder)))
    finally:
        logging.disable(logging.NOTSET)  # called from a test, the process logs on
    text = summarize(results, time.monotonic() - began)
    print(text)
    bad = [c for c in results if c.leaked or c.output_lost or c.healthy_terminated]
    for c in bad[:5]:
        print(
            f"seed {c.seed}: leaked {c.leaked} lost {c.output_lost} killed {c.healthy_terminated}"
        )
    if write:
        write_section(Path(__file__).resolve().parent / "RESULTS.md", text, schedules)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
