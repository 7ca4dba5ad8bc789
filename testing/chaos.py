"""Seeded random schedules of submits, cancels, faults and relay crashes.

Each schedule drives the real RunService and Reaper on a real SQLite file against a
backend: the shipped in-memory provider's world (``relay/providers/memory.py``, fast: hundreds of
schedules), or a real provider SDK against its protocol-level fake (its rig, ``testing/rigs``).
A crash abandons a relay process the way ``kill -9`` does: its provider client and store
writes stop dead, its sandboxes stay alive at the provider, and a new relay process starts
on the same database. At the end every sandbox must be terminated and every run final.
Used by ``tests/runs/test_chaos.py`` and by the leak report (``bench/leaks.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, get_args

from relay.auth import Principal
from relay.errors import RelayError
from relay.providers.contract import ExecResult, Provider, SandboxRef, SandboxSpec
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.providers.registry import load_provider
from relay.run_state import FINAL, RunState
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.settings import Settings
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.rigs import RIGS
from testing.rigs.rig import FakeRig, Fault
from testing.settings import make_settings

PRINCIPAL = Principal(name="chaos", command=True)


class ProcessDied(BaseException):
    """Raised where a crashed relay process would have done its next thing: nothing."""


class DeadStore:
    """A crashed process's store: reads work (nobody cares), writes never happen."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if name in ("update_run", "admit_run", "heartbeat") and callable(attribute):

            async def write(*args: Any, **kwargs: Any) -> Any:
                if self.dead:
                    raise ProcessDied
                return await attribute(*args, **kwargs)

            return write
        return attribute


class CrashableProvider:
    """A real provider client that can die like its process: after ``crash()`` nothing it
    was doing finishes, so whatever it created stays alive at the provider."""

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.name: ClassVar[str]  # type: ignore[misc]
        self.rate = inner.rate
        self.dead = False

    def crash(self) -> None:
        self.dead = True

    async def _hang_if_dead(self) -> None:
        if self.dead:
            raise ProcessDied

    def check(self, spec: SandboxSpec) -> None:
        self.inner.check(spec)

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Any]:
        manager = self.inner.sandbox(spec)
        box = await manager.__aenter__()
        try:
            yield _CrashableSandbox(self, box)
        except BaseException as exc:
            if not self.dead and not await manager.__aexit__(type(exc), exc, exc.__traceback__):
                raise
            raise
        else:
            if not self.dead:
                await manager.__aexit__(None, None, None)

    async def list_owned(self) -> list[SandboxRef]:
        await self._hang_if_dead()
        return await self.inner.list_owned()

    async def terminate(self, sandbox_id: str) -> None:
        await self._hang_if_dead()
        await self.inner.terminate(sandbox_id)

    async def aclose(self) -> None:
        # Called by the test harness only, to free this process's sockets at the end.
        await self.inner.aclose()


class _CrashableSandbox:
    def __init__(self, owner: CrashableProvider, box: Any) -> None:
        self.owner, self.box, self.id = owner, box, box.id
        self.provenance = box.provenance

    async def upload(self, files: Mapping[str, bytes]) -> None:
        await self.owner._hang_if_dead()
        await self.box.upload(files)

    async def exec(self, argv: Sequence[str], **kwargs: Any) -> ExecResult:
        await self.owner._hang_if_dead()
        result: ExecResult = await self.box.exec(argv, **kwargs)
        await self.owner._hang_if_dead()
        return result


class Backend(Protocol):
    """A provider as the schedules see it: clients, ground truth, faults."""

    name: str
    timeout_s: tuple[float, float]

    def new_client(self, settings: Settings) -> Any: ...
    def alive(self) -> set[str]: ...
    def inject(self, rng: random.Random) -> None: ...
    def heal(self) -> None: ...
    def command(self, rng: random.Random) -> list[str]: ...
    def ended(self) -> dict[str, tuple[str, str | None, float | None]]: ...


def inject_fault(faults: Any, rng: random.Random, vanish_after_s: float) -> None:
    """Arm one of the contract's faults (every fake has them under the same names)."""
    choice = rng.choice(get_args(Fault))
    value = {
        "create_status": rng.choice([500, 503, 429]),
        "terminate_failures": 3,
        "vanish_after_s": vanish_after_s,
    }.get(choice, True)
    setattr(faults, choice, value)


@dataclass
class MemoryBackend:
    """The shipped memory provider; each relay process gets its own client of one world."""

    world: MemoryWorld = field(default_factory=MemoryWorld)
    name: str = "memory"
    timeout_s: tuple[float, float] = (0.01, 0.08)

    def new_client(self, settings: Settings) -> CrashableProvider:
        return CrashableProvider(MemoryProvider(settings, self.world))

    def alive(self) -> set[str]:
        return self.world.alive()

    def inject(self, rng: random.Random) -> None:
        inject_fault(self.world.faults, rng, vanish_after_s=0.02)

    def heal(self) -> None:
        self.world.reset()

    def command(self, rng: random.Random) -> list[str]:
        return ["sh", "-c", f"sleep {rng.uniform(0, 0.05):.3f}; exit {rng.choice([0, 0, 1])}"]

    def ended(self) -> dict[str, tuple[str, str | None, float | None]]:
        return {b.id: (b.run_id, b.ended_by, b.ended_at) for b in self.world.boxes.values()}


@dataclass
class FakeBackend:
    """A real SDK against its fake, through the provider's rig (``testing/rigs``)."""

    rig: FakeRig
    name: str = field(init=False)
    timeout_s: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self) -> None:
        self.name = self.rig.name

    @property
    def fake(self) -> Any:
        return self.rig.fake

    @property
    def settings(self) -> dict[str, object]:
        """What points a relay at the fake: ``Relay`` adds it to each relay's settings."""
        return self.rig.values

    def new_client(self, settings: Settings) -> CrashableProvider:
        return CrashableProvider(load_provider(self.name, settings))

    def alive(self) -> set[str]:
        return self.rig.alive()

    def inject(self, rng: random.Random) -> None:
        inject_fault(self.rig.faults, rng, vanish_after_s=0.3)

    def heal(self) -> None:
        self.rig.reset()

    def command(self, rng: random.Random) -> list[str]:
        return ["sh", "-c", f"sleep {rng.uniform(0, 1):.2f}; exit {rng.choice([0, 0, 1])}"]

    def ended(self) -> dict[str, tuple[str, str | None, float | None]]:
        # The fakes' ledgers know what was created and what is alive, not who ended it.
        return {str(i): ("", None, None) for i, _ in enumerate(self.rig.created())}


@dataclass
class Report:
    seed: int
    backend: str = "memory"
    created: int = 0
    ended_by_run: int = 0
    ended_by_reaper: int = 0
    vanished: int = 0
    leaked: list[str] = field(default_factory=list)
    not_final: list[str] = field(default_factory=list)
    worst_past_deadline_s: float = 0.0
    restarts: int = 0
    runs: int = 0

    @property
    def ok(self) -> bool:
        return not self.leaked and not self.not_final


class Relay:
    """One relay 'process': a service, a reaper and a provider client."""

    def __init__(self, store: Store, backend: Backend, tmp: Path, extra: Mapping[str, Any]) -> None:
        values = {
            "providers": [backend.name],
            "create_timeout_s": 0.1 if backend.name == "memory" else 3,
            "grace_s": 5,
            "drain_s": 0,
            "max_concurrent": 1000,
            **extra,  # a fake backend's rig values: its provider, keys and URLs
        }
        self.settings = make_settings(tmp, **values)
        self.store = DeadStore(store)
        self.provider = backend.new_client(self.settings)
        providers = {backend.name: self.provider}
        self.service = RunService(self.settings, self.store, Catalog({}), providers)  # type: ignore[arg-type]
        self.reaper = Reaper(
            self.store,  # type: ignore[arg-type]
            providers,
            self.settings,
            holds=self.service.holds,
            instance_id=self.service.instance_id,
            events=self.service.events,
            grace_s=self.settings.grace_s,
            single_replica=True,
        )

    async def crash(self) -> None:
        self.provider.crash()
        self.store.dead = True
        tasks = list(self.service.runner.tasks())
        for task in tasks:
            task.cancel()
        # Each task stops at its next store write or provider call; collect them so no
        # exception goes unretrieved.
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()


async def run_schedule(
    seed: int, tmp: Path, backend: Backend | None = None, steps: int = 30
) -> Report:
    """Play one seeded schedule; return what happened to every sandbox."""
    backend = backend or MemoryBackend()
    extra = getattr(backend, "settings", {})
    rng = random.Random(seed)
    tmp.mkdir(parents=True, exist_ok=True)
    store = await Store.open(f"sqlite:///{tmp / 'chaos.db'}")
    report = Report(seed, backend.name)
    relay = Relay(store, backend, tmp, extra)
    relays = [relay]
    await relay.reaper.sweep()
    submitted: list[str] = []
    try:
        for _ in range(steps):
            action = rng.choices(
                ["submit", "cancel", "fault", "heal", "crash", "sleep", "sweep"],
                [10, 2, 3, 2, 1, 4, 2],
            )[0]
            if action == "submit":
                request = RunRequest(
                    command=backend.command(rng),
                    timeout_s=rng.uniform(*backend.timeout_s),
                    wait=False,
                )
                with contextlib.suppress(RelayError):
                    row, _ = await relay.service.submit(PRINCIPAL, request, None)
                    submitted.append(row.id)
            elif action == "cancel" and submitted:
                with contextlib.suppress(RelayError):
                    await relay.service.cancel(PRINCIPAL, rng.choice(submitted))
            elif action == "fault":
                backend.inject(rng)
            elif action == "heal":
                backend.heal()
            elif action == "crash":
                await relay.crash()
                report.restarts += 1
                relay = Relay(store, backend, tmp, extra)
                relays.append(relay)
                await relay.reaper.sweep()
            elif action == "sweep":
                await relay.reaper.sweep()
            else:
                await asyncio.sleep(rng.uniform(0, 0.02 if backend.name == "memory" else 0.3))
        # Heal the provider, let the live relay finish its runs, sweep until all is gone.
        backend.heal()
        tasks = set(relay.service.runner.tasks())
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for _ in range(10):
            await relay.reaper.sweep()
            if not backend.alive():
                break
            await asyncio.sleep(0 if backend.name == "memory" else 0.2)
    finally:
        for old in relays:
            with contextlib.suppress(Exception):
                await old.provider.aclose()
        await store.close()
    return _account(report, backend, await final_rows(tmp, submitted))


async def final_rows(tmp: Path, ids: list[str]) -> dict[str, RunRecord]:
    """The rows of ``ids`` in a schedule's database, read once every relay has stopped."""
    store = await Store.open(f"sqlite:///{tmp / 'chaos.db'}")
    try:
        return await store.runs_by_id(ids)
    finally:
        await store.close()


def _account(report: Report, backend: Backend, rows: dict[str, RunRecord]) -> Report:
    report.runs = len(rows)
    report.leaked = sorted(backend.alive())
    report.not_final = sorted(i for i, r in rows.items() if RunState(r.state) not in FINAL)
    ended = backend.ended()
    report.created = len(ended)
    for run_id, by, at in ended.values():
        if by == "run":
            report.ended_by_run += 1
        elif by == "reaper":
            report.ended_by_reaper += 1
        elif by == "vanished":
            report.vanished += 1
        row = rows.get(run_id)
        if row is not None and at is not None:
            report.worst_past_deadline_s = max(report.worst_past_deadline_s, at - row.deadline)
    return report


async def run_many(seeds: range, tmp: Path, parallel: int = 8) -> list[Report]:
    """Play in-memory schedules ``parallel`` at a time, each on its own database."""
    reports: list[Report] = []
    for start in range(seeds.start, seeds.stop, parallel):
        batch = range(start, min(start + parallel, seeds.stop))
        reports += await asyncio.gather(*(run_schedule(s, tmp / f"s{s}") for s in batch))
    return reports


@contextlib.contextmanager
def fake_backend(name: str, tmp: Path) -> Iterator[FakeBackend]:
    """Start the named provider's rig (its fake) and wrap it as a schedule backend."""
    with RIGS[name].started(tmp) as rig:
        assert isinstance(rig, FakeRig), f"{name} has no fake to play schedules on"
        yield FakeBackend(rig)


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    import sys
    import tempfile

    began = time.monotonic()
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    name = sys.argv[2] if len(sys.argv) > 2 else "memory"
    with tempfile.TemporaryDirectory() as folder:
        if name == "memory":
            result = asyncio.run(run_schedule(seed, Path(folder)))
        else:
            with fake_backend(name, Path(folder)) as chosen:
                result = asyncio.run(run_schedule(seed, Path(folder), chosen, steps=12))
        print(result, f"{time.monotonic() - began:.1f}s")
