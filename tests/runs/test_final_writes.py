"""A finished run is never lost: its final write is retried until the store takes it.

The service runs for real (local provider with bubblewrap, a real SQLite file); the store
refuses writes the way a real one does: the database switched to read-only
(``PRAGMA query_only``), or its file on a full tmpfs (as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError
from starlette.testclient import TestClient

from relay.auth import Principal, new_token
from relay.http.app import create_app
from relay.providers.contract import SANDBOX_MARKER
from relay.providers.local.provider import LocalProvider
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import WRITE_CHECK_EVERY_S, Store
from relay.store.records import RunRecord
from relay.store.sqlite.wal_checkpointer import Checkpointer
from tests.conftest import REPO, make_settings

PRINCIPAL = Principal(name="writer", command=True)


@dataclass
class Refusal:
    """Turns the store's refusal of writes on and off."""

    start: Callable[[], None]
    stop: Callable[[], None]


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def refuse_writes(database: Path) -> None:
    """Write up what space the WAL's file holds past its last frame (left from before it
    last started over), so that the disk, full, refuses the store's next write."""
    scratch = sqlite3.connect(database, timeout=5)
    try:
        scratch.execute("PRAGMA wal_autocheckpoint=0")
        for number in range(1, 100_000):  # a frame each: a 1 MiB disk holds ~250
            scratch.execute(f"PRAGMA user_version = {number}")
    except sqlite3.OperationalError as exc:
        if "full" not in str(exc):
            raise
    else:
        raise AssertionError("the full disk never refused a write")
    finally:
        scratch.close()


def release(run_id: str, job: str | None = None) -> None:
    """Send the job of ``run_id`` (``job``, else :data:`WAITING_JOB`) the signal that ends
    it; it is found on the host by its sandbox's marker (30 s at most: a busy machine
    starts it late)."""
    job = job or WAITING_JOB
    marker = f"{SANDBOX_MARKER}=lcl-{run_id.removeprefix('run_')}-".encode()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[:3] == [b"sh", b"-c", job.encode()] and any(
                value.startswith(marker) for value in environ
            ):
                os.kill(int(entry.name), signal.SIGUSR1)
                return
        time.sleep(0.05)
    raise AssertionError(f"the job of {run_id} was not found running")


WAITING_JOB = "trap 'echo kept; echo also >&2; exit 3' USR1; while :; do sleep 0.05; done"
"""A job that ends (output, exit 3) when the test says: after the store refuses writes."""


@dataclass
class Rig:
    service: RunService
    reaper: Reaper
    store: Store
    refusal: Refusal


@pytest.fixture(params=["read_only", "full_disk"])
async def rig(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Rig]:
    with contextlib.ExitStack() as exits:
        folder = tmp_path
        if request.param == "full_disk":
            if os.geteuid() != 0:
                pytest.skip("mounting a tmpfs needs root")
            folder = exits.enter_context(small_tmpfs(tmp_path / "disk", "1m"))
        database_url = f"sqlite:///{folder / 'relay.db'}"
        settings = make_settings(
            tmp_path, database_url=database_url, local_isolation="bwrap", max_concurrent=1
        )
        store = await Store.open(database_url)
        service = RunService(
            settings, store, Catalog.load(REPO / "jobs"), {"local": LocalProvider(settings)}
        )
        reaper = Reaper(
            store,
            service.providers,
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=5,
            single_replica=True,
        )
        assert store.commits is not None
        driver = store.commits._driver
        filler = folder / "filler"
        held: list[Checkpointer] = []

        def fill() -> None:
            # The store's checkpoints held: one that copies the whole WAL back lets the next
            # write start the WAL over, in space its file already holds, and land on a full
            # disk (as SQLite does); held, the WAL only grows, which a full disk refuses.
            assert store.checkpointer is not None
            held.append(store.checkpointer)
            store.checkpointer.stop()
            with open(filler, "wb") as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            refuse_writes(folder / "relay.db")

        def unfill() -> None:
            filler.unlink(missing_ok=True)
            if held:
                held.clear()
                store.checkpointer = Checkpointer(str(folder / "relay.db"))
                store.checkpointer.start()

        if request.param == "read_only":
            refusal = Refusal(
                lambda: driver.execute("PRAGMA query_only = 1"),
                lambda: driver.execute("PRAGMA query_only = 0"),
            )
        else:
            refusal = Refusal(fill, unfill)
        try:
            yield Rig(service, reaper, store, refusal)
        finally:
            refusal.stop()
            await service.shutdown()
            await store.close()


async def stored_state(rig: Rig, run_id: str) -> str | None:
    stored = await rig.store.get_run(run_id)
    return stored.state if stored else None


async def outcome(rig: Rig, run_id: str) -> str:
    return (await rig.service.get(PRINCIPAL, run_id)).state


async def until(read: Callable[[], Awaitable[str | None]], wanted: str) -> None:
    """Poll ``read`` until it says ``wanted`` (30 s at most)."""
    deadline = time.monotonic() + 30
    while (seen := await read()) != wanted:
        assert time.monotonic() < deadline, f"still {seen!r}, not {wanted!r}"
        await asyncio.sleep(0.02)


async def refused_for_sure(rig: Rig) -> None:
    """Make the store refuse writes, and see it refuse one of its own before going on: a
    write that the full disk still took (SQLite reusing space its WAL holds) fills it
    again, rather than the run's final write landing where the test means it refused."""
    for _ in range(5):
        rig.refusal.start()
        try:
            await rig.store.heartbeat(rig.service.instance_id)
        except DBAPIError:
            return
    raise AssertionError("the store kept taking writes")


async def test_a_final_write_the_store_refuses_lands_once_it_recovers(rig: Rig) -> None:
    request = RunRequest(command=["sh", "-c", WAITING_JOB], wait=False)
    row, _ = await rig.service.submit(PRINCIPAL, request, None)
    run_id = row.id
    # Running, its `running` state stored (waited for: a busy machine may take a while).
    await until(lambda: stored_state(rig, run_id), "running")
    await refused_for_sure(rig)
    await asyncio.to_thread(release, run_id)  # the job ends only now
    # The job has ended; its final write was refused.
    await until(lambda: outcome(rig, run_id), "failed")
    stored = await rig.store.get_run(run_id)
    assert stored is not None and stored.state == "running"
    # This process still answers for the run: its own reaper leaves it alone, and a GET
    # here reads the outcome kept in memory.
    assert rig.service.holds(run_id)
    assert (await rig.reaper.sweep(dry_run=True)).lost_runs == []
    seen = await rig.service.get(PRINCIPAL, run_id)
    assert seen.state == "failed" and seen.exit_code == 3
    rig.refusal.stop()
    for _ in range(100):
        stored = await rig.store.get_run(run_id)
        assert stored is not None
        if stored.state != "running":
            break
        await asyncio.sleep(0.1)
    assert stored.state == "failed" and stored.exit_code == 3
    assert stored.stdout == "kept\n" and stored.stderr == "also\n"
    assert not rig.service.holds(run_id)
    # Its concurrency slot (max_concurrent=1) is free again.
    again, new = await rig.service.submit(PRINCIPAL, RunRequest(command=["true"]), None)
    assert new and (await rig.service.wait(again.id, 10)).state == "succeeded"


async def test_a_run_owned_here_with_no_task_is_an_orphan_for_its_own_reaper(
    tmp_path: Path,
) -> None:
    """Multi-replica rules (PostgreSQL) on a SQLite file: the owner's heartbeat is live,
    but no task of it holds the run, so nobody else will ever finish it."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        service = RunService(make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {})
        reaper = Reaper(
            store,
            {},
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=30,
            single_replica=False,
        )
        await store.heartbeat(service.instance_id)
        row = RunRecord(**{
            "id": "run_unheld",
            "token": "writer",
            "provider": "local",
            "state": "running",
            "request_hash": "",
            "timeout_s": 3600,
            "cpu": 1.0,
            "memory_mb": 512,
            "created_at": 1.0,
            "deadline": 4e9,
            "reserved_usd": 0.0,
            "owner": service.instance_id,
            "stdout": "",
            "stderr": "",
            "timings": "{}",
        })  # fmt: skip
        await store.admit_run(row)
        assert (await reaper.sweep()).lost_runs == ["run_unheld"]
    finally:
        await store.close()


async def test_a_run_that_ends_while_its_own_reaper_sweeps_is_no_orphan(
    tmp_path: Path,
) -> None:
    """The sweep reads the active runs, then the replicas' beats, then asks which runs this
    process holds: a run that ended meanwhile (final write, then its hold let go) was read
    active and found unheld, and was counted lost and its sandbox terminated as orphaned
    (the lost write itself was refused: the run was final)."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        service = RunService(make_settings(tmp_path), store, Catalog.load(REPO / "jobs"), {})
        reaper = Reaper(
            store,
            {},
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=30,
            single_replica=False,
        )
        await store.heartbeat(service.instance_id)
        row = RunRecord(**{
            "id": "run_ending",
            "token": "writer",
            "provider": "local",
            "state": "running",
            "request_hash": "",
            "timeout_s": 3600,
            "cpu": 1.0,
            "memory_mb": 512,
            "created_at": 1.0,
            "deadline": 4e9,
            "reserved_usd": 0.0,
            "owner": service.instance_id,
            "stdout": "",
            "stderr": "",
            "timings": "{}",
        })  # fmt: skip
        service.runner.hold(row.id)
        await store.admit_run(row)
        beats = store.replica_beats

        async def beats_while_the_run_ends() -> dict[str, Any]:
            await store.update_run(row.id, state="succeeded", ended_at=time.time())
            service.runner.release(row.id)  # as its task does, after the final write
            return await beats()

        store.replica_beats = beats_while_the_run_ends  # type: ignore[method-assign]
        report = await reaper.sweep()
        assert report.lost_runs == []
        assert (await store.get_run(row.id)).state == "succeeded"  # type: ignore[union-attr]
    finally:
        await store.close()


@pytest.mark.slow  # waits out /readyz's write check twice: 6 s
def test_a_store_refusing_writes_is_503_store_unavailable_and_not_ready(
    tmp_path: Path,
) -> None:
    """The relay's SQLite refuses writes (read-only): a new run is a 503
    ``store_unavailable`` with ``Retry-After`` (not a 500), ``/readyz`` fails, and both
    recover once it takes writes again."""
    settings = make_settings(tmp_path, local_isolation="bwrap")
    token = new_token(settings.tokens_file, "ops", command=True)
    headers = {"Authorization": f"Bearer {token}"}
    body = {"command": ["true"]}
    with TestClient(create_app(settings)) as client:
        store = client.app.state.relay.store  # type: ignore[attr-defined]
        assert client.get("/readyz").status_code == 200
        store.commits._driver.execute("PRAGMA query_only = 1")
        time.sleep(WRITE_CHECK_EVERY_S)  # /readyz writes again only after this
        answer = client.post("/v1/runs", json=body, headers=headers)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "store_unavailable"
        assert int(answer.headers["Retry-After"]) >= 1
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["store"] == "not writable"
        store.commits._driver.execute("PRAGMA query_only = 0")
        time.sleep(WRITE_CHECK_EVERY_S)
        assert client.get("/readyz").status_code == 200
        answer = client.post("/v1/runs", json=body, headers=headers)
        assert answer.status_code == 200 and answer.json()["state"] == "succeeded"


@pytest.mark.slow  # waits out the final writes' backoff: seconds
async def test_a_burst_fired_as_get_shows_final_after_an_outage_is_admitted_in_full(
    tmp_path: Path,
) -> None:
    """Issue 37, item 2. Four runs fill the relay (``RELAY_MAX_CONCURRENT=4``) and end while
    the store refuses writes; a caller polling ``GET`` sees them final (from memory) once
    the store is back, and fires four new runs at once. The old runs' final writes were
    sleeping out their backoff (seconds), so the store still counted them running: 429s
    although nothing ran. Now a run whose outcome is known here is not counted, and the
    first write the store takes wakes the waiting final writes at once."""
    settings = make_settings(tmp_path, local_isolation="bwrap", max_concurrent=4, token_share=1.0)
    store = await Store.open(settings.database_url)
    service = RunService(
        settings, store, Catalog.load(REPO / "jobs"), {"local": LocalProvider(settings)}
    )
    assert store.commits is not None
    driver = store.commits._driver
    try:
        old = []
        for number in range(4):
            request = RunRequest(command=["sh", "-c", f"sleep 0.5; echo old{number}"], wait=False)
            old.append((await service.submit(PRINCIPAL, request, None))[0].id)
        await asyncio.sleep(0.3)  # running, their `running` state stored
        driver.execute("PRAGMA query_only = 1")
        for _ in range(100):  # they end; their final writes are refused and back off
            seen = [await service.get(PRINCIPAL, run_id) for run_id in old]
            if all(run.state.final for run in seen):
                break
            await asyncio.sleep(0.1)
        # Past 3 s of refusals the next try is 3 s away (0.1 s doubling).
        await asyncio.sleep(3.3)
        driver.execute("PRAGMA query_only = 0")
        seen = [await service.get(PRINCIPAL, run_id) for run_id in old]
        assert [run.state for run in seen] == ["succeeded"] * 4  # what a caller sees now
        fired = time.monotonic()
        burst = [
            (await service.submit(PRINCIPAL, RunRequest(command=["true"], wait=False), None))[0]
            for _ in range(4)
        ]  # a 429 would raise here
        stored: list[RunRecord | None] = []
        while time.monotonic() - fired < 10:
            stored = [await store.get_run(run_id) for run_id in old]
            if all(run is not None and run.state.final for run in stored):
                break
            await asyncio.sleep(0.02)
        landed_after_s = time.monotonic() - fired
        assert landed_after_s < 1.0, f"the final writes landed {landed_after_s:.1f} s later"
        assert [run.stdout if run else None for run in stored] == [f"old{n}\n" for n in range(4)]
        for run in burst:
            assert (await service.wait(run.id, 10)).state == "succeeded"
    finally:
        await service.shutdown()
        await store.close()
