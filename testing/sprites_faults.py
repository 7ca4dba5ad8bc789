"""The faults that leak on a provider with no lifetime of its own, played on the Sprites fake.

A sprite lives until something deletes it, so each of these must leave 0 sprites once the
next sweep has run:

* a create whose answer comes after the relay gave up (the sprite exists);
* a network-policy call that fails right after a good create;
* a relay killed (``kill -9``, a real process) while one run's command runs and another
  run's create is still under way (the store knows the first sprite, only a listing finds
  the second).

Used by ``tests/providers/test_provider_sprites.py`` and the leak report (``bench/leaks.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from relay.errors import RelayError
from relay.run_state import FINAL, RunState
from relay.runs.models import RunRequest
from relay.store.database import Store
from testing.chaos import PRINCIPAL, FakeBackend, Relay, Report, fake_backend
from testing.fakes.sprites import FakeSprites
from testing.relay_server import RelayProcess

LATE_CREATE = "a late create answer"
FAILING_POLICY = "a failing network-policy call"
KILLED = "kill -9 mid-run and mid-create"
FAULTS = (LATE_CREATE, FAILING_POLICY, KILLED)


def _report(fault: str, fake: FakeSprites, before: int, runs: int, open_runs: list[str]) -> Report:
    """What became of the sprites created since ``before`` (the ledger's count then)."""
    made = {entry["name"] for entry in fake.ledger.created[before:]}
    report = Report(0, f"sprites: {fault}", created=len(made), runs=runs)
    report.leaked = sorted(made & fake.ledger.alive())
    report.not_final = open_runs
    return report


async def in_process(fault: str, backend: FakeBackend, folder: Path) -> Report:
    """A run meets a create-time fault in a relay on a real store; then the next sweep."""
    folder.mkdir(parents=True, exist_ok=True)
    fake: FakeSprites = backend.fake
    before = len(fake.ledger.created)
    store = await Store.open(f"sqlite:///{folder / 'leaks.db'}")
    relay = Relay(store, backend, folder, backend.settings)
    try:
        if fault == LATE_CREATE:
            fake.faults.create_delay_s = relay.settings.create_timeout_s + 1
        else:
            fake.faults.policy_status = 500
        request = RunRequest(command=["true"], timeout_s=60, wait=False)
        run, _ = await relay.service.submit(PRINCIPAL, request, None)
        tasks = set(relay.service.runner.tasks())
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        fake.reset()
        await relay.reaper.sweep()
        row = await store.get_run(run.id)
    finally:
        with contextlib.suppress(RelayError, OSError):
            await relay.provider.aclose()
        await store.close()
    final = row is not None and RunState(row.state) in FINAL
    return _report(fault, fake, before, 1, [] if final else [run.id])


def _until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def killed_relay(fake: FakeSprites, folder: Path) -> Report:
    """A real relay is killed while a run's command runs and another run's create is under
    way; the next relay on the same store must end both sprites and mark both runs lost."""
    settings = {"providers": "sprites", "sprites_base_url": fake.url, "sprites_token": "t"}
    first = RelayProcess(folder / "relay", **settings)
    token = first.add_token("ops", command=True)
    before = len(fake.ledger.created)
    first.start()
    try:
        running = first.post(token, {"command": ["sleep", "60"], "wait": False}).json()["id"]
        _until(lambda: bool(fake.ledger.commands) and bool(fake.ledger.alive()), 20)
        fake.faults.create_delay_s = 60.0  # the sprite exists; its create answers too late
        creating = first.post(token, {"command": ["true"], "wait": False}).json()["id"]
        _until(lambda: len(fake.ledger.created) - before == 2, 20)
    finally:
        first.kill()  # SIGKILL: no finally, no shielded exit, nothing
    fake.reset()
    second = RelayProcess(folder / "relay", **settings)
    second.tokens = first.tokens
    second.start()
    try:
        states = {
            run_id: second.wait_final(token, run_id, 30)["state"] for run_id in (running, creating)
        }
        made = {entry["name"] for entry in fake.ledger.created[before:]}
        _until(lambda: not made & fake.ledger.alive(), 20)
    finally:
        second.stop()
    return _report(
        KILLED, fake, before, len(states), [run for run, state in states.items() if state != "lost"]
    )


def every_fault(folder: Path) -> list[Report]:
    """Each of :data:`FAULTS` once, on one Sprites fake; prints a line for each."""
    reports: list[Report] = []
    with fake_backend("sprites", folder) as backend:
        for number, fault in enumerate(FAULTS):
            began = time.monotonic()
            place = folder / f"sprites-fault{number}"
            if fault == KILLED:
                report = killed_relay(backend.fake, place)
            else:
                report = asyncio.run(in_process(fault, backend, place))
            print(
                f"sprites, {fault} (real SDK, fake): sprites created: {report.created}, "
                f"leaked after the next sweep: {len(report.leaked)}, "
                f"runs left open: {len(report.not_final)}, "
                f"wall time: {time.monotonic() - began:.1f} s"
            )
            reports.append(report)
    return reports
