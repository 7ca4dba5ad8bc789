"""Seeded chaos schedules over a route of two providers, with provider outages.

Each schedule plays submits, cancels, faults, outages of one provider (every create refused,
or hanging past the create timeout), heals, crashes and sweeps against relays whose runs are
routed over two memory worlds (``memory`` then ``spare``: relay/runs/route.py), either one
relay on SQLite or two replicas at once on one PostgreSQL database. A crash abandons a relay
as ``kill -9`` does (testing/chaos.py: its provider clients and its store writes, the final
ones included, stop dead). At the end, every run must be final, no command may have run
twice (the worlds' ledgers of commands started, by run), no sandbox may be alive, and every
run that finished (``succeeded``, ``failed``) must carry what its command printed.
Used by ``tests/runs/test_chaos.py``; replay one with
``python -m testing.route_chaos SEED [postgresql://…]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.errors import RelayError
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import FINAL, RunState
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import Store
from testing.chaos import PRINCIPAL, CrashableProvider, DeadStore, ProcessDied, inject_fault
from testing.settings import make_settings

PROVIDERS = ("memory", "spare")
"""The route, in order: two worlds, two clients of each relay."""


class DeadReplicaStore(DeadStore):
    """A crashed replica's store: its final writes stop dead too (the reaper then finds its
    runs orphaned, as after a real ``kill -9``)."""

    def __getattr__(self, name: str) -> Any:
        attribute = super().__getattr__(name)
        if name == "finish_run" and callable(attribute):
            store = self

            async def finish(*args: Any, **kwargs: Any) -> Any:
                if store.dead:
                    raise ProcessDied
                return await attribute(*args, **kwargs)

            return finish
        return attribute


@dataclass
class RouteReport:
    """What happened in one schedule."""

    seed: int
    replicas: int = 1
    runs: int = 0
    created: int = 0
    failovers: int = 0
    restarts: int = 0
    leaked: list[str] = field(default_factory=list)
    not_final: list[str] = field(default_factory=list)
    run_twice: list[str] = field(default_factory=list)
    outputs_lost: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.leaked or self.not_final or self.run_twice or self.outputs_lost)


class RoutedRelay:
    """One relay process whose runs are routed over the worlds, with its reaper."""

    def __init__(
        self, store: Store, worlds: dict[str, MemoryWorld], tmp: Path, *, replicas: int
    ) -> None:
        self.settings = make_settings(
            tmp,
            providers=list(PROVIDERS),
            create_timeout_s=0.1,
            route_create_budget_s=0.5,
            breaker_failures=2,
            breaker_cooldown_s=0.05,
            grace_s=5,
            drain_s=0,
            max_concurrent=1000,
        )
        self.store = DeadReplicaStore(store)
        self.providers = {
            name: CrashableProvider(MemoryProvider(self.settings, world))
            for name, world in worlds.items()
        }
        self.service = RunService(self.settings, self.store, Catalog({}), self.providers)  # type: ignore[arg-type]
        self.failovers = 0
        self.service.events.subscribe(self._count)
        self.reaper = Reaper(
            self.store,  # type: ignore[arg-type]
            self.providers,  # type: ignore[arg-type]
            self.settings,
            holds=self.service.holds,
            instance_id=self.service.instance_id,
            events=self.service.events,
            grace_s=self.settings.grace_s,
            single_replica=replicas == 1,
        )

    def _count(self, event: Any) -> None:
        if event.kind == "attempt":
            self.failovers += 1

    async def crash(self) -> None:
        for provider in self.providers.values():
            provider.crash()
        self.store.dead = True
        tasks = list(self.service.runner.tasks())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()


def _outage(worlds: dict[str, MemoryWorld], rng: random.Random) -> None:
    """One provider goes down: every create refused (503, 429), or hanging."""
    faults = worlds[rng.choice(PROVIDERS)].faults
    if rng.random() < 0.5:
        faults.create_hang = True
    else:
        faults.create_status = rng.choice([503, 429, 500])


async def run_route_schedule(
    seed: int, tmp: Path, *, database_url: str | None = None, replicas: int = 1, steps: int = 40
) -> RouteReport:
    """Play one seeded schedule over the route; ``database_url`` (PostgreSQL) and
    ``replicas`` (2) play replicas at once on one database."""
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    url = database_url or f"sqlite:///{tmp / 'route.db'}"
    store = await Store.open(url)
    worlds = {name: MemoryWorld() for name in PROVIDERS}
    report = RouteReport(seed, replicas=replicas)
    relays = [RoutedRelay(store, worlds, tmp / f"r{i}", replicas=replicas) for i in range(replicas)]
    every = list(relays)
    printed: dict[str, str] = {}
    try:
        for _ in range(steps):
            action = rng.choices(
                ["submit", "cancel", "fault", "outage", "heal", "crash", "sleep", "sweep"],
                [12, 1, 2, 3, 3, 1, 4, 2],
            )[0]
            relay = rng.choice(relays)
            if action == "submit":
                marker = secrets.token_hex(4)
                script = (
                    f"sleep {rng.uniform(0, 0.05):.3f}; echo {marker}; exit {rng.choice([0, 1])}"
                )
                request = RunRequest(
                    command=["sh", "-c", script], timeout_s=rng.uniform(0.02, 0.1), wait=False
                )
                with contextlib.suppress(RelayError):
                    row, _ = await relay.service.submit(PRINCIPAL, request, None)
                    printed[row.id] = marker + "\n"
            elif action == "cancel" and printed:
                with contextlib.suppress(RelayError):
                    await relay.service.cancel(PRINCIPAL, rng.choice(list(printed)))
            elif action == "fault":
                inject_fault(worlds[rng.choice(PROVIDERS)].faults, rng, vanish_after_s=0.02)
            elif action == "outage":
                _outage(worlds, rng)
            elif action == "heal":
                worlds[rng.choice(PROVIDERS)].reset()
            elif action == "crash":
                await relay.crash()
                report.restarts += 1
                fresh = RoutedRelay(store, worlds, tmp / f"r{len(every)}", replicas=replicas)
                relays[relays.index(relay)] = fresh
                every.append(fresh)
                await fresh.reaper.sweep()
            elif action == "sweep":
                await relay.store.heartbeat(relay.service.instance_id)
                await relay.reaper.sweep()
            else:
                await asyncio.sleep(rng.uniform(0, 0.02))
        # Heal both providers, let the live relays finish their runs, then sweep until
        # nothing is left (every other replica judged dead: the live ones hold nothing).
        for world in worlds.values():
            world.reset()
        tasks = {task for relay in relays for task in relay.service.runner.tasks()}
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for _ in range(10):
            for relay in relays:
                await relay.reaper.sweep(judge_now=True)
            if not any(world.alive() for world in worlds.values()):
                break
            await asyncio.sleep(0)
        report.failovers = sum(relay.failovers for relay in every)
        rows = await store.runs_by_id(list(printed))
    finally:
        for old in every:
            for provider in old.providers.values():
                with contextlib.suppress(Exception):
                    await provider.aclose()
        await store.close()
    return _account(report, worlds, rows, printed)


def _account(
    report: RouteReport,
    worlds: dict[str, MemoryWorld],
    rows: dict[str, Any],
    printed: dict[str, str],
) -> RouteReport:
    report.runs = len(rows)
    report.created = sum(len(world.boxes) for world in worlds.values())
    report.leaked = sorted(box for world in worlds.values() for box in world.alive())
    report.not_final = sorted(i for i, row in rows.items() if RunState(row.state) not in FINAL)
    started = Counter(run for world in worlds.values() for _, run in world.started)
    report.run_twice = sorted(run for run, count in started.items() if count > 1)
    report.outputs_lost = sorted(
        run_id
        for run_id, row in rows.items()
        if row.state in (RunState.succeeded, RunState.failed) and row.stdout != printed[run_id]
    )
    return report


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    import sys
    import tempfile

    chosen = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    given = sys.argv[2] if len(sys.argv) > 2 else None
    with tempfile.TemporaryDirectory() as folder:
        print(
            asyncio.run(
                run_route_schedule(
                    chosen, Path(folder), database_url=given, replicas=2 if given else 1
                )
            )
        )
