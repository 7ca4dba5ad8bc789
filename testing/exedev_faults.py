"""The faults that leak on exe.dev, which gives a VM no lifetime of its own, played on its fake.

A VM lives until something deletes it, so each of these must leave 0 VMs once the next sweep
has run:

* a create whose answer never comes (the VM exists; the SDK would wait ten minutes for the
  answer and shields a cancelled ``new()``), answered late once the relay has given up;
* a relay killed (``kill -9``, a real process) while one run's command runs and another
  run's create hangs (the store knows the first VM, only a listing by tag finds the second).

Used by ``tests/providers/test_provider_exedev.py`` and the leak report (``bench/leaks.py``).
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
from testing.fakes.exedev import FakeExedev
from testing.relay_server import RelayProcess

HUNG_CREATE = "a create that never answers, then answers late"
KILLED = "kill -9 mid-run and mid-create"
FAULTS = (HUNG_CREATE, KILLED)


def _report(fault: str, fake: FakeExedev, before: int, runs: int, open_runs: list[str]) -> Report:
    """What became of the VMs created since ``before`` (the ledger's count then)."""
    made = {entry["name"] for entry in fake.ledger.created[before:]}
    report = Report(0, f"exedev: {fault}", created=len(made), runs=runs)
    report.leaked = sorted(made & fake.ledger.alive())
    report.not_final = open_runs
    return report


async def hung_create(backend: FakeBackend, folder: Path) -> Report:
    """A run's create never answers, in a relay on a real store; the late answer comes once
    the run has failed; then the next sweep."""
    folder.mkdir(parents=True, exist_ok=True)
    fake: FakeExedev = backend.fake
    before = len(fake.ledger.created)
    store = await Store.open(f"sqlite:///{folder / 'leaks.db'}")
    relay = Relay(store, backend, folder, backend.settings)
    try:
        fake.faults.create_hang = True
        request = RunRequest(command=["true"], timeout_s=60, wait=False)
        run, _ = await relay.service.submit(PRINCIPAL, request, None)
        tasks = set(relay.service.runner.tasks())
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        fake.reset()  # the answer, too late
        await relay.reaper.sweep()
        row = await store.get_run(run.id)
    finally:
        with contextlib.suppress(RelayError, OSError):
            await relay.provider.aclose()
        await store.close()
    final = row is not None and RunState(row.state) in FINAL
    return _report(HUNG_CREATE, fake, before, 1, [] if final else [run.id])


def _until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def killed_relay(fake: FakeExedev, folder: Path) -> Report:
    """A real relay is killed while a run's command runs and another run's create hangs; the
    next relay on the same store must delete both VMs and mark both runs lost."""
    settings = {"providers": "exedev", "exedev_url": fake.url, "exedev_token": "t"}
    first = RelayProcess(folder / "relay", **settings)
    token = first.add_token("ops", command=True)
    before = len(fake.ledger.created)
    first.start()
    try:
        running = first.post(token, {"command": ["sleep", "60"], "wait": False}).json()["id"]
        _until(lambda: any("relay-follow" in c["command"] for c in fake.ledger.commands), 20)
        fake.faults.create_hang = True  # the VM exists; its create never answers
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
    """Each of :data:`FAULTS` once, on one exe.dev fake; prints a line for each."""
    reports: list[Report] = []
    with fake_backend("exedev", folder) as backend:
        for number, fault in enumerate(FAULTS):
            began = time.monotonic()
            place = folder / f"exedev-fault{number}"
            if fault == KILLED:
                report = killed_relay(backend.fake, place)
            else:
                report = asyncio.run(hung_create(backend, place))
            print(
                f"exedev, {fault} (real SDK, fake): VMs created: {report.created}, "
                f"leaked after the next sweep: {len(report.leaked)}, "
                f"runs left open: {len(report.not_final)}, "
                f"wall time: {time.monotonic() - began:.1f} s"
            )
            reports.append(report)
    return reports
