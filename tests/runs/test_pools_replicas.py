"""Two whole relays (app, provider driver, pools, reaper) on one PostgreSQL and one
provider world: pooled runs sent to both at once.

What must hold across replicas: no sandbox serves two runs, a pooled row is claimed once
and only by a run of the replica that holds it, ``RELAY_POOL_MAX`` counts both replicas'
pools together, and when both have shut down nothing is alive and every row is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from relay.auth import new_token
from relay.http.app import create_app
from relay.providers.contract import POOL_PREFIX
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.runs.pools import Pools
from relay.runs.reaper import Reaper
from relay.settings import Settings
from relay.store.database import Store
from relay.store.pools import ENDED, PoolRows
from relay.store.schema import pooled, runs
from tests.conftest import make_settings, new_database
from tests.runs.test_pools import until, write_job

pytestmark = pytest.mark.postgres

CAP = 3
"""RELAY_POOL_MAX: below the two replicas' wanted 2 + 2, so the cap is what stops them."""


@contextlib.asynccontextmanager
async def replica(
    settings: Settings, world: MemoryWorld, instance_id: str, reapers: dict[str, Reaper]
) -> AsyncIterator[tuple[httpx.AsyncClient, Pools]]:
    """One complete relay, its lifespan run, answering through an in-process client; its
    reaper goes into ``reapers``."""
    app = create_app(
        settings, instance_id=instance_id, providers={"memory": MemoryProvider(settings, world)}
    )
    async with app.router.lifespan_context(app):
        reapers[instance_id] = app.state.relay.reaper
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
            yield client, app.state.relay.service.pools


async def test_two_replicas_share_one_cap_and_never_share_a_sandbox(
    tmp_path: Path, postgres_url: str
) -> None:
    url = await new_database(postgres_url)
    jobs = write_job(tmp_path / "jobs", warm=2)
    shared: dict[str, Any] = {
        "database_url": url,
        "jobs_dir": jobs,
        "tokens_file": tmp_path / "tokens.toml",
        "providers": ["memory"],
        "grace_s": 5,
        "pool_max": CAP,
        "reap_interval_s": 0.2,
    }
    token = new_token(shared["tokens_file"], "ops", jobs=["warm"])
    headers = {"Authorization": f"Bearer {token}"}
    world = MemoryWorld()
    reapers: dict[str, Reaper] = {}
    observer = await Store.open(url)
    rows = PoolRows(observer)
    waiting_seen: list[int] = []

    async def watch() -> None:
        while True:
            waiting_seen.append(await rows.waiting())
            await asyncio.sleep(0.01)

    async def send(client: httpx.AsyncClient) -> dict[str, Any]:
        body = {"job": "warm", "files": {"secret.txt": "x"}}
        answer = await client.post("/v1/runs", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        run: dict[str, Any] = answer.json()
        assert run["state"] == "succeeded", run
        return run

    watcher = asyncio.create_task(watch())
    answers: list[dict[str, Any]] = []
    try:  # the observer's connections are closed however the test ends
        try:
            # A hung run fails the test here, in time for both lifespans and the watcher
            # to end before pytest's own timeout would.
            async with (
                asyncio.timeout(120),
                replica(make_settings(tmp_path / "a", **shared), world, "replica-a", reapers) as (
                    first,
                    a,
                ),
                replica(make_settings(tmp_path / "b", **shared), world, "replica-b", reapers) as (
                    second,
                    b,
                ),
            ):
                for _ in range(4):  # rounds: each drains the pools, which refill in between
                    # Filled when both replicas get to it: seconds on a loaded host.
                    await until(lambda: a.ready + b.ready >= CAP, within_s=20)
                    answers += await asyncio.gather(*(send(c) for c in [first, second] * 3))
                await asyncio.sleep(0.3)  # a few reaper sweeps on both, with both alive
                usage = (await second.get("/v1/usage", headers=headers)).json()["today"]
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        every = await observer.read(lambda conn: list(conn.execute(sa.select(pooled))))
        owners = await observer.read(
            lambda conn: {
                row.id: row.owner for row in conn.execute(sa.select(runs.c.id, runs.c.owner))
            }
        )
    finally:
        await observer.close()

    served = [run for run in answers if run["timings"]["pooled"]]
    assert len(served) >= 8, "too few pooled runs to show anything"
    assert len({run["sandbox_id"] for run in answers}) == len(answers)  # none shared
    claimed = [row for row in every if row.run_id is not None]
    assert len({row.run_id for row in claimed}) == len(claimed)  # one claim per run
    assert {row.run_id for row in claimed} == {run["id"] for run in served}
    for row in claimed:
        assert owners[row.run_id] == row.holder  # only its holder's runs claim it
        assert row.sandbox_id == next(r["sandbox_id"] for r in served if r["id"] == row.run_id)
    assert {row.holder for row in claimed} == {"replica-a", "replica-b"}
    # The token's /v1/usage: the idle time of the sandboxes its runs claimed, on either
    # replica; not that of those drained unclaimed at shutdown.
    assert usage["pool_idle_seconds"] == pytest.approx(sum(row.idle_s for row in claimed), abs=0.01)
    assert max(waiting_seen) == CAP  # RELAY_POOL_MAX over both replicas
    assert world.alive() == set()
    assert {row.state for row in every} == {ENDED}
    pooled_boxes = {box.id for box in world.boxes.values() if box.run_id.startswith(POOL_PREFIX)}
    assert {row.sandbox_id for row in every if row.sandbox_id} == pooled_boxes
    # Each replica ended its own sandboxes: no reaper had to step in for a live replica.
    # But b drains first, while a's reaper still sweeps: a drain ends its ready sandboxes'
    # rows, then terminates them, and a sandbox whose row is ended may be terminated by a's
    # reaper first (pool_ended; reproduced with each row's end made 0.5 s slower). Only
    # that: b's sandboxes, by that rule.
    reasons = {name: dict(reaper.terminated_by_reason) for name, reaper in reapers.items()}
    by_reaper = {box for box in pooled_boxes if world.boxes[box].ended_by != "run"}
    assert by_reaper <= {row.sandbox_id for row in every if row.holder == "replica-b"}, reasons
    if by_reaper:  # none judged the other dead (pool_orphaned)
        assert set(reasons["replica-a"]) & {"pool_ended", "pool_orphaned"} == {"pool_ended"}, (
            reasons
        )
