"""Seeded random schedules of submits, cancels, faults and relay crashes.

Each schedule drives the real RunService and Reaper on a real SQLite file, against the
in-memory provider world (``tests/fakes/memory.py``). A crash abandons a relay process the
way ``kill -9`` does: its provider client and its store writes stop dead, its sandboxes stay
alive at the provider, and a new relay process starts on the same database. At the end,
every sandbox must be terminated and every run final. Used by ``tests/test_chaos.py`` and
by the leak report in ``bench/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.auth import Principal
from relay.catalog import Catalog
from relay.errors import RelayError
from relay.models import FINAL_STATES, RunRequest, RunState
from relay.reaper import Reaper
from relay.service import RunService
from relay.store import Store
from tests.conftest import make_settings
from tests.fakes.memory import MemoryProvider, MemoryWorld

PRINCIPAL = Principal(name="chaos", command=True)


class DeadStore:
    """A crashed process's store: reads work (nobody cares), writes go nowhere."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if name in ("update_run", "insert_run", "admit_run", "heartbeat") and callable(attribute):

            async def write(*args: Any, **kwargs: Any) -> Any:
                if self.dead:
                    await asyncio.sleep(3600)  # a dead process never gets there
                return await attribute(*args, **kwargs)

            return write
        return attribute


@dataclass
class Report:
    seed: int
    created: int = 0
    ended_by_run: int = 0
    ended_by_reaper: int = 0
    vanished: int = 0
    leaked: list[str] = field(default_factory=list)
    not_final: list[str] = field(default_factory=list)
    worst_past_deadline_s: float = 0.0
    restarts: int = 0

    @property
    def ok(self) -> bool:
        return not self.leaked and not self.not_final


class Relay:
    """One relay 'process': a service, a reaper and a provider client."""

    def __init__(self, store: Store, world: MemoryWorld, tmp: Path) -> None:
        self.settings = make_settings(
            tmp,
            providers=["memory"],
            create_timeout_s=0.1,
            grace_s=5,
            drain_s=0,
            max_concurrent=1000,
        )
        self.store = DeadStore(store)
        self.provider = MemoryProvider(world, self.settings.cluster, 0.1)
        self.service = RunService(
            self.settings,
            self.store,  # type: ignore[arg-type]
            Catalog({}),
            {"memory": self.provider},  # type: ignore[dict-item]
        )
        self.reaper = Reaper(
            self.store,  # type: ignore[arg-type]
            {"memory": self.provider},  # type: ignore[dict-item]
            self.service,
            grace_s=self.settings.grace_s,
            single_replica=True,
        )

    def crash(self) -> None:
        self.provider.crash()
        self.store.dead = True
        for task in list(self.service._tasks.values()):
            task.cancel()


async def run_schedule(seed: int, tmp: Path, steps: int = 30) -> Report:
    """Play one seeded schedule; return what happened to every sandbox."""
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    store = await Store.open(f"sqlite+aiosqlite:///{tmp / 'chaos.db'}")
    world = MemoryWorld()
    report = Report(seed)
    relay = Relay(store, world, tmp)
    await relay.reaper.sweep()
    submitted: list[str] = []
    try:
        for _ in range(steps):
            action = rng.choices(
                ["submit", "cancel", "fault", "crash", "sleep", "sweep"], [10, 2, 3, 1, 4, 2]
            )[0]
            if action == "submit":
                request = RunRequest(
                    command=["run", f"{rng.uniform(0, 0.05):.3f}", str(rng.choice([0, 0, 1]))],
                    timeout_s=rng.uniform(0.01, 0.08),
                    wait=False,
                )
                with contextlib.suppress(RelayError):
                    row, _ = await relay.service.submit(PRINCIPAL, request, None)
                    submitted.append(row["id"])
            elif action == "cancel" and submitted:
                with contextlib.suppress(RelayError):
                    await relay.service.cancel(PRINCIPAL, rng.choice(submitted))
            elif action == "fault":
                fault = rng.choice(
                    ["create_failures", "create_hangs", "allocate_then_fail",
                     "terminate_failures", "vanish_next", "cut_stream_next"]
                )  # fmt: skip
                setattr(world.faults, fault, rng.randint(1, 3))
            elif action == "crash":
                relay.crash()
                report.restarts += 1
                relay = Relay(store, world, tmp)
                await relay.reaper.sweep()
            elif action == "sweep":
                await relay.reaper.sweep()
            else:
                await asyncio.sleep(rng.uniform(0, 0.02))
        # Let the live relay finish its runs, then sweep until terminates stop failing.
        tasks = set(relay.service._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for _ in range(10):
            await relay.reaper.sweep()
            if not world.alive():
                break
    finally:
        await store.close()
    return _account(report, world, await _final_rows(tmp, submitted))


async def _final_rows(tmp: Path, ids: list[str]) -> dict[str, dict[str, Any]]:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp / 'chaos.db'}")
    try:
        return await store.runs_by_id(ids)
    finally:
        await store.close()


def _account(report: Report, world: MemoryWorld, rows: dict[str, dict[str, Any]]) -> Report:
    report.created = len(world.boxes)
    report.leaked = sorted(world.alive())
    report.not_final = sorted(
        i for i, r in rows.items() if RunState(r["state"]) not in FINAL_STATES
    )
    for box in world.boxes.values():
        if box.ended_by == "run":
            report.ended_by_run += 1
        elif box.ended_by == "reaper":
            report.ended_by_reaper += 1
        elif box.ended_by == "vanished":
            report.vanished += 1
        row = rows.get(box.run_id)
        if row is not None and box.ended_at is not None:
            past = box.ended_at - (row["deadline"])
            report.worst_past_deadline_s = max(report.worst_past_deadline_s, past)
    return report


async def run_many(seeds: range, tmp: Path, parallel: int = 8) -> list[Report]:
    """Play schedules ``parallel`` at a time, each on its own database."""
    reports: list[Report] = []
    for start in range(seeds.start, seeds.stop, parallel):
        batch = range(start, min(start + parallel, seeds.stop))
        reports += await asyncio.gather(*(run_schedule(s, tmp / f"s{s}") for s in batch))
    return reports


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    import sys
    import tempfile

    began = time.monotonic()
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    with tempfile.TemporaryDirectory() as folder:
        print(asyncio.run(run_schedule(seed, Path(folder))), time.monotonic() - began)
