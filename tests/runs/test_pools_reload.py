"""Warm pools follow a jobs reload (relay/runs/jobs_folder.py, ``Pools.follow``): a job whose
shape changed gets a new pool and the old sandboxes are terminated, a smaller pool sheds
sandboxes, a new job's pool fills, a removed job's pool empties, and a sandbox still being
created for a pool that went is terminated once made. On the memory provider, through the
composition root, as ``SIGHUP`` and ``POST /v1/jobs/reload`` reach it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from relay.auth import Principal, new_token
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.runs.models import SIZES, RunRequest, Size
from relay.runtime import Relay
from relay.settings import Settings
from relay.store.database import Store
from relay.store.pools import ENDED, PoolRows
from tests.conftest import make_settings

PRINCIPAL = Principal(name="ops", command=True)


def write_job(jobs: Path, name: str, *, warm: int, size: str = "small", timeout_s: int = 5) -> None:
    (jobs / name).mkdir(parents=True, exist_ok=True)
    (jobs / name / "job.toml").write_text(
        f'command = ["echo", "{name}"]\nsize = "{size}"\ntimeout_s = {timeout_s}\nwarm = {warm}\n'
    )


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def relay(tmp_path: Path, world: MemoryWorld, **values: object) -> AsyncIterator[Relay]:
    settings: Settings = make_settings(
        tmp_path, jobs_dir=tmp_path / "jobs", providers=["memory"], grace_s=5, **values
    )
    new_token(settings.tokens_file, "ops")
    async with Relay.open(settings, providers={"memory": MemoryProvider(settings, world)}) as one:
        await one.start()
        yield one


def pooled_ids(one: Relay, job: str) -> set[str]:
    pool = one.pools.pools.get((job, "memory"))
    return {ready.box.id for ready in pool.ready.values()} if pool else set()


async def test_pools_follow_a_changed_shape_a_new_size_a_new_job_and_a_removed_one(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    jobs = tmp_path / "jobs"
    write_job(jobs, "warm", warm=2)
    write_job(jobs, "later", warm=0)
    async with relay(tmp_path, world) as one:
        await until(lambda: one.pools.ready == 2)
        small = pooled_ids(one, "warm")

        write_job(jobs, "warm", warm=2, size="medium")  # a new shape: a new pool
        done = await one.reload_jobs()
        assert done.changed == ("warm",) and not done.added and not done.removed
        assert small.isdisjoint(world.alive()), "the old shape's sandboxes outlived the reload"
        await until(lambda: one.pools.ready == 2)
        pool = one.pools.pools[("warm", "memory")]
        assert pool.shape.resources.cpu == SIZES[Size.medium][0]
        ran, _ = await one.service.submit(PRINCIPAL, RunRequest(job="warm"), None)
        ran = await one.service.wait(ran.id, 10)
        assert ran.state == "succeeded" and ran.stdout == "warm\n"
        assert json.loads(ran.timings)["pooled"] is True  # the new shape's pool serves it
        await until(lambda: one.pools.ready == 2)

        write_job(jobs, "warm", warm=1, size="medium")  # the same shape, smaller
        kept = pooled_ids(one, "warm")
        await one.reload_jobs()
        assert one.pools.pools[("warm", "memory")] is pool  # the same pool, its sandboxes kept
        assert len(pooled_ids(one, "warm")) == 1 and pooled_ids(one, "warm") <= kept
        assert world.alive() == pooled_ids(one, "warm")

        write_job(jobs, "later", warm=1)  # a job that now wants a pool gets one
        assert (await one.reload_jobs()).changed == ("later",)
        await until(lambda: len(pooled_ids(one, "later")) == 1)

        shutil.rmtree(jobs / "warm")  # a job gone: its pool and sandboxes go
        last = pooled_ids(one, "warm")
        assert (await one.reload_jobs()).removed == ("warm",)
        assert ("warm", "memory") not in one.pools.pools
        assert last.isdisjoint(world.alive()) and world.alive() == pooled_ids(one, "later")
        await asyncio.sleep(0.2)  # nothing refills a pool that went
        assert world.alive() == pooled_ids(one, "later")
    assert world.alive() == set()
    await _all_rows_ended(tmp_path, world)


async def _all_rows_ended(tmp_path: Path, world: MemoryWorld) -> None:
    """Every pooled sandbox's row is ended, the relay closed: none left for a reaper."""
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        rows = await PoolRows(store).by_id([box.run_id for box in world.boxes.values()])
    finally:
        await store.close()
    assert len(rows) == len(world.boxes) and {row.state for row in rows.values()} == {ENDED}


async def test_a_longer_timeout_retires_the_pool_its_sandboxes_lifetime_would_not_cover(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    write_job(tmp_path / "jobs", "warm", warm=1, timeout_s=5)
    async with relay(tmp_path, world) as one:
        await until(lambda: one.pools.ready == 1)
        before = pooled_ids(one, "warm")
        write_job(tmp_path / "jobs", "warm", warm=1, timeout_s=50)
        await one.reload_jobs()
        assert before.isdisjoint(world.alive())
        await until(lambda: one.pools.ready == 1)
        assert one.pools.pools[("warm", "memory")].timeout_s == 50


async def test_a_sandbox_still_being_created_for_a_pool_that_went_is_terminated_once_made(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    world.faults.create_delay_s = 0.5
    write_job(tmp_path / "jobs", "warm", warm=1)
    async with relay(tmp_path, world) as one:
        await until(lambda: len(world.created()) == 1)  # its create is under way
        shutil.rmtree(tmp_path / "jobs" / "warm")
        await one.reload_jobs()
        await until(lambda: world.boxes[world.created()[0]].ended_at is not None)
        assert world.alive() == set() and one.pools.ready == 0
        await asyncio.sleep(0.6)
        assert len(world.created()) == 1  # and none replaces it
    await _all_rows_ended(tmp_path, world)


async def test_relay_pool_warm_naming_a_removed_job_warns_and_the_pool_comes_back_with_it(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    jobs = tmp_path / "jobs"
    write_job(jobs, "warm", warm=0)
    async with relay(tmp_path, world, pool_warm={"warm": 1}) as one:
        await until(lambda: one.pools.ready == 1)
        shutil.move(jobs / "warm", tmp_path / "aside")
        done = await one.reload_jobs()
        assert done.removed == ("warm",) and world.alive() == set()
        (warning,) = done.warnings
        assert "RELAY_POOL_WARM" in warning and "'warm'" in warning
        shutil.move(tmp_path / "aside", jobs / "warm")
        done = await one.reload_jobs()
        assert done.added == ("warm",) and not done.warnings
        await until(lambda: one.pools.ready == 1)
