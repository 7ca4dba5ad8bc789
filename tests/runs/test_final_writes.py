"""A finished run is never lost: its final write is retried until the store takes it.

The service runs for real (local provider with bubblewrap, a real SQLite file); the store
refuses writes the way a real one does: the database switched to read-only
(``PRAGMA query_only``), or its file on a full tmpfs (as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from relay.auth import Principal, new_token
from relay.http.app import create_app
from relay.providers.local.provider import LocalProvider
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import WRITE_CHECK_EVERY_S, Store
from relay.store.records import RunRecord
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

        def fill() -> None:
            with open(filler, "wb") as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()

        if request.param == "read_only":
            refusal = Refusal(
                lambda: driver.execute("PRAGMA query_only = 1"),
                lambda: driver.execute("PRAGMA query_only = 0"),
            )
        else:
            refusal = Refusal(fill, lambda: filler.unlink(missing_ok=True))
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


async def test_a_final_write_the_store_refuses_lands_once_it_recovers(rig: Rig) -> None:
    request = RunRequest(
        command=["sh", "-c", "sleep 0.6; echo kept; echo also >&2; exit 3"], wait=False
    )
    row, _ = await rig.service.submit(PRINCIPAL, request, None)
    run_id = row.id
    # Running, its `running` state stored (waited for: a busy machine may take a while).
    await until(lambda: stored_state(rig, run_id), "running")
    rig.refusal.start()
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
