"""Warm pools: a run of a pooled job gets a sandbox created ahead, used once, then ended.

On the memory provider (a provider whose create is the wait): claims, single use, refill,
the cold path for another shape or a burst, idle expiry and its cost, the lifetime
(extended at claim, or capped), drain at shutdown, the reaper after a kill -9, and
exclusive claims in the store (SQLite and PostgreSQL). On local, whose create costs less
than a claim, a job's ``warm`` is skipped: its runs take the cold path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import sqlalchemy as sa

from relay.auth import Principal
from relay.http.app import create_app
from relay.http.metrics import Metrics
from relay.providers.contract import POOL_PREFIX, Provider
from relay.providers.local.provider import LocalProvider
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus
from relay.runs.models import RunRequest, Size
from relay.runs.pools import PoolStats
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.settings import Settings
from relay.store import retention
from relay.store.database import Store
from relay.store.pools import CLAIMED, CREATING, ENDED, READY, PoolRecord, PoolRows
from relay.store.records import RunRecord
from relay.store.schema import pooled
from relay.token_file import new_token
from tests.conftest import make_settings

PRINCIPAL = Principal(name="pooler", command=True)

JOB = """
command = ["sh", "-c", "cat secret.txt"]
timeout_s = 5
allow = ["files", "size"]
warm = {warm}
"""


def write_job(root: Path, warm: int, text: str = JOB, name: str = "warm") -> Path:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "job.toml").write_text(text.format(warm=warm))
    return root


def memory_settings(tmp_path: Path, warm: int = 2, **values: object) -> Settings:
    jobs = write_job(tmp_path / "jobs", warm)
    return make_settings(tmp_path, jobs_dir=jobs, providers=["memory"], grace_s=5, **values)


def pool_row(name: str, *, created_at: float, **values: Any) -> PoolRecord:
    """A row of ``pooled`` for job ``warm`` on memory, shape ``s``, held by ``one``."""
    fields: dict[str, Any] = {
        "id": POOL_PREFIX + name,
        "shape": "s",
        "job": "warm",
        "provider": "memory",
        "holder": "one",
        "state": READY,
        "cpu": 1.0,
        "memory_mb": 1024,
        "created_at": created_at,
        "expires_at": created_at + 60,
    }
    return PoolRecord(**{**fields, **values})


class FixedLifetimeMemory(MemoryProvider):
    """A memory provider that cannot extend a sandbox's lifetime (like Modal)."""

    extends_lifetime: ClassVar[bool] = False


@contextlib.asynccontextmanager
async def relay(
    settings: Settings,
    world: MemoryWorld,
    *,
    instance_id: str = "one",
    provider: type[MemoryProvider] = MemoryProvider,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[RunService]:
    store = await Store.open(settings.database_url)
    providers: dict[str, Provider] = {"memory": provider(settings, world)}
    service = RunService(
        settings,
        store,
        Catalog.load(settings.jobs_dir),
        providers,
        instance_id=instance_id,
        clock=clock,
    )
    service.start()
    try:
        yield service
    finally:
        await service.shutdown()
        await store.close()


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.01)


async def run(service: RunService, **body: object) -> RunRecord:
    request = RunRequest.model_validate({"job": "warm", **body})
    run, _ = await service.submit(PRINCIPAL, request, None)
    return await service.wait(run.id, 10)


def timings(run: RunRecord) -> dict[str, object]:
    timing: dict[str, object] = json.loads(run.timings)
    return timing


async def test_a_pooled_sandbox_serves_one_run_then_ends_and_is_replaced(tmp_path: Path) -> None:
    world = MemoryWorld()
    async with relay(memory_settings(tmp_path), world) as service:
        await until(lambda: service.pools.ready == 2)
        pooled_ids = set(world.alive())
        first = await run(service, files={"secret.txt": "run one's secret"})
        assert first.state == "succeeded" and first.stdout == "run one's secret"
        assert timings(first)["pooled"] is True and first.sandbox_id in pooled_ids
        assert first.sandbox_id not in world.alive()  # terminated after its one run
        second = await run(service)  # the same shape: another pooled sandbox
        assert timings(second)["pooled"] is True and second.sandbox_id in pooled_ids
        assert second.sandbox_id != first.sandbox_id
        assert second.state == "failed" and "run one's secret" not in second.stdout
        await until(lambda: service.pools.ready == 2)  # refilled in the background
        assert len(world.created()) == 4 and service.pools.stats.claimed == 2
    assert world.alive() == set()  # shutdown drained the pool
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    rows = await PoolRows(store).by_id([box.run_id for box in world.boxes.values()])
    await store.close()
    assert {row.state for row in rows.values()} == {ENDED} and len(rows) == 4


async def test_a_burst_over_the_pool_and_another_shape_take_the_cold_path(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    async with relay(memory_settings(tmp_path), world) as service:
        await until(lambda: service.pools.ready == 2)
        burst = await asyncio.gather(*(run(service, files={"secret.txt": "x"}) for _ in range(5)))
        assert all(one.state == "succeeded" for one in burst)
        assert sorted(timings(one)["pooled"] is True for one in burst) == [False] * 3 + [True] * 2
        assert len({one.sandbox_id for one in burst}) == 5
        await until(lambda: service.pools.ready == 2)
        bigger = await run(service, size=Size.medium, files={"secret.txt": "x"})
        assert bigger.state == "succeeded" and timings(bigger)["pooled"] is False
        assert service.pools.ready == 2  # nothing of the pool was used


async def test_pool_max_caps_every_pool_together_and_default_is_off(tmp_path: Path) -> None:
    world = MemoryWorld()
    settings = memory_settings(tmp_path, warm=2, pool_max=3)
    write_job(settings.jobs_dir, 2, name="other")
    write_job(settings.jobs_dir, 0, name="cold")
    async with relay(settings, world) as service:
        assert service.pools.size == 4 and {job for job, _ in service.pools.pools} == {
            "warm",
            "other",
        }
        await until(lambda: service.pools.ready == 3)
        await asyncio.sleep(0.3)
        assert service.pools.ready == 3 and len(world.created()) == 3
    off = memory_settings(tmp_path / "off", warm=2, pool_warm={"warm": 0})
    async with relay(off, world) as service:
        assert service.pools.pools == {}
        done = await run(service, files={"secret.txt": "x"})
        assert timings(done)["pooled"] is False


async def test_idle_sandboxes_expire_are_replaced_and_their_cost_is_recorded(
    tmp_path: Path,
) -> None:
    world = MemoryWorld()
    settings = memory_settings(
        tmp_path, pool_idle_s=0.5, cost_rates={"memory": {"vcpu_s": 1.0, "gib_s": 0.0}}
    )
    async with relay(settings, world, provider=FixedLifetimeMemory) as service:
        await until(lambda: service.pools.ready == 2)
        first = set(world.alive())
        # Without extension, the hard lifetime covers idle time + the job's timeout + grace.
        assert {world.boxes[box].lifetime_s for box in first} == {0.5 + 5 + 5 + 0.5}
        await until(lambda: service.pools.stats.expired >= 2 and service.pools.ready == 2)
        assert first.isdisjoint(world.alive())  # the idle ones were terminated and replaced
        assert {world.boxes[box].ended_by for box in first} == {"run"}
        today, month = await service.usage(Principal(name="ops", admin=True))
        assert today.pool_idle_s >= 1.0 and today.pool_idle_usd >= 0.5  # 0.5 vCPU (small)
        assert month.pool_idle_s == today.pool_idle_s
        metrics = Metrics()
        metrics.attach(service, None, EventBus(), ["memory"])
        text = metrics.render().decode()
        assert 'relay_pool_sandboxes_total{event="expired"}' in text
        assert "relay_pool_ready 2.0" in text and "relay_pool_size 2.0" in text
        assert service.pools.stats.idle_usd > 0


async def test_the_lifetime_is_extended_at_claim_where_the_provider_can(tmp_path: Path) -> None:
    world = MemoryWorld()
    async with relay(memory_settings(tmp_path, warm=1, pool_idle_s=30), world) as service:
        await until(lambda: service.pools.ready == 1)
        (box,) = (world.boxes[box_id] for box_id in world.alive())
        assert box.lifetime_s == 30 + 5  # idle time and grace only, until a run claims it
        done = await run(service, files={"secret.txt": "x"})
        assert timings(done)["pooled"] is True and done.sandbox_id == box.id
        assert box.lifetime_s == pytest.approx(time.time() - box.created_at + 5 + 5, abs=1)


async def test_the_store_gives_a_sandbox_to_one_claim_only(database_url: str) -> None:
    stores = [await Store.open(database_url) for _ in range(2)]
    try:
        rows = [PoolRows(store) for store in stores]
        now = time.time()
        for index in range(6):
            await rows[0].add(
                pool_row(
                    str(index),
                    sandbox_id=f"box-{index}",
                    created_at=now,
                    expires_at=now + (60 if index else -1),  # the first one: idle too long
                ),
                cap=100,
            )
        claims = await asyncio.gather(
            *(rows[i % 2].claim("one", "s", f"run_{i}", now, 0.0) for i in range(16)),
            rows[1].end(f"{POOL_PREFIX}5", now, 0.0, states=(READY,)),
        )
        won = [claim for claim in claims[:-1] if claim is not None]
        ended = claims[-1]
        assert len({claim.id for claim in won}) == len(won) == (4 if ended else 5)
        assert f"{POOL_PREFIX}0" not in {claim.id for claim in won}  # past its idle time
        states = {row.id: row.state for row in (await rows[0].by_id([r.id for r in won])).values()}
        assert set(states.values()) == {CLAIMED}
        assert await rows[1].claim("one", "s", "run_late", now, 0.0) is None
    finally:
        for store in stores:
            await store.close()


async def test_replicas_adding_at_once_never_pass_the_cap_together(database_url: str) -> None:
    """RELAY_POOL_MAX holds across replicas: the count and the insert are one transaction
    (under a lock on PostgreSQL; SQLite has one writer, one replica)."""
    replicas = 1 if database_url.startswith("sqlite") else 3
    stores = [await Store.open(database_url) for _ in range(replicas)]
    try:
        rows = [PoolRows(store) for store in stores]
        now = time.time()

        def record(index: int) -> PoolRecord:
            return pool_row(
                f"cap{index}", holder=f"replica-{index % replicas}", state=CREATING, created_at=now
            )

        added = await asyncio.gather(*(rows[i % replicas].add(record(i), cap=3) for i in range(12)))
        assert sum(added) == 3
        assert await rows[0].waiting() == 3
    finally:
        for store in stores:
            await store.close()


async def test_retention_deletes_old_ended_pool_rows_only(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    rows, now = PoolRows(store), time.time()
    for name, state, created in (
        ("old", ENDED, now - 100),
        ("new", ENDED, now),
        ("idle", READY, 0),
    ):
        record = pool_row(name, state=state, created_at=created, expires_at=created + 1)
        await rows.add(record, cap=100)
    assert (await retention.prune(store, now - 50)).pooled == 1
    left = await rows.by_id([POOL_PREFIX + name for name in ("old", "new", "idle")])
    await store.close()
    assert sorted(left) == [POOL_PREFIX + "idle", POOL_PREFIX + "new"]


async def test_the_reaper_ends_the_pool_of_a_relay_killed_outright(tmp_path: Path) -> None:
    world = MemoryWorld()
    settings = memory_settings(tmp_path)
    store = await Store.open(settings.database_url)
    dead = RunService(
        settings,
        store,
        Catalog.load(settings.jobs_dir),
        {"memory": MemoryProvider(settings, world)},
        instance_id="dead",
    )
    dead.start()
    await until(lambda: dead.pools.ready == 2)
    assert dead.pools._loop is not None
    dead.pools._loop.cancel()  # kill -9: nothing of that process runs any more
    await store.close()
    orphans = set(world.alive())
    async with relay(settings, world, instance_id="next") as service:
        await until(lambda: service.pools.ready == 2)
        reaper = Reaper(
            service.store,
            service.providers,
            settings,
            holds=service.holds,
            instance_id="next",
            grace_s=settings.grace_s,
            single_replica=True,
        )
        report = await reaper.sweep()
        assert {sandbox for _, sandbox in report.terminated} == orphans
        assert world.alive().isdisjoint(orphans) and len(world.alive()) == 2  # its own live
        assert reaper.terminated_by_reason["pool_orphaned"] == 2
        assert (await reaper.sweep()).terminated == []


async def test_a_warm_local_job_holds_no_sandbox_and_its_runs_take_the_cold_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Local's create (a folder and a cgroup) costs less than a pool's claim: its job's
    ``warm = N`` loads, is logged once with the reason and shown as skipped, keeps no
    sandbox, and its runs are cold, with no claim and no pooled row."""
    job = """
command = ["sh", "-c", "echo ran"]
timeout_s = 5
provider = "local"
warm = {warm}
"""
    settings = make_settings(
        tmp_path,
        jobs_dir=write_job(tmp_path / "jobs", 2, job),
        providers=["local"],
        local_isolation="bwrap",
        grace_s=5,
    )
    store = await Store.open(settings.database_url)
    local = LocalProvider(settings)
    caplog.set_level(logging.WARNING, "relay.pools")
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), {"local": local})
    service.start()
    try:
        assert service.pools.pools == {} and service.pools.size == 0
        assert service.runner.sources["local"] is local  # its own door, no pool in front
        (skipped,) = service.pools.skipped.values()
        assert (skipped.job, skipped.provider) == ("warm", "local")
        assert skipped.reason == LocalProvider.skips_warm_pools
        await service.pools.tend()  # a refill's turn finds nothing to fill
        assert await local.list_owned() == []
        ran = await run(service)
        assert ran.state == "succeeded" and ran.stdout == "ran\n"
        assert timings(ran)["pooled"] is False
        assert service.pools.stats == PoolStats()  # nothing created, nothing claimed
        assert await PoolRows(store).waiting() == 0
        await service.pools.follow(Catalog.load(settings.jobs_dir))  # a reload: still skipped
        assert list(service.pools.skipped) == ["warm"] and service.pools.pools == {}
    finally:
        await service.shutdown()
        assert await local.list_owned() == []
        await local.aclose()
        await store.close()
    logged = [record.getMessage() for record in caplog.records if record.name == "relay.pools"]
    assert logged == [f"no warm pool: {LocalProvider.skips_warm_pools}"]  # once, with why


class CheapCreate(MemoryProvider):
    """A memory provider whose create would be cheaper than a claim: it says so of itself."""

    skips_warm_pools: ClassVar[str | None] = "its create costs less than a claim"


class MemoryAsLocal(MemoryProvider):
    """The memory provider under local's name, without local's trait: it keeps its pool."""

    name = "local"


async def test_health_lists_a_skipped_pool_by_the_providers_own_word_not_its_name(
    tmp_path: Path,
) -> None:
    """The provider's class says it skips pools (here one named ``memory``); one named
    ``local`` that does not say so keeps its pool: ``/v1/health`` shows both."""
    jobs = write_job(tmp_path / "jobs", 1, JOB + 'provider = "memory"\n', name="cheap")
    write_job(jobs, 1, JOB + 'provider = "local"\n', name="pooled")
    settings = make_settings(tmp_path, jobs_dir=jobs, providers=["memory", "local"], grace_s=5)
    token = new_token(settings.tokens_file, "ops", admin=True)
    world = MemoryWorld()
    providers: dict[str, Provider] = {
        "memory": CheapCreate(settings, world),
        "local": MemoryAsLocal(settings, MemoryWorld()),
    }
    app = create_app(settings, providers=providers)
    async with app.router.lifespan_context(app):
        pools = app.state.relay.service.pools
        await until(lambda: pools.ready == 1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
            answer = await client.get("/v1/health", headers={"Authorization": f"Bearer {token}"})
        health = answer.json()["pools"]
        assert health["size"] == health["ready"] == 1  # the job on "local"
        assert health["skipped"] == [
            {"job": "cheap", "provider": "memory", "reason": "its create costs less than a claim"}
        ]
        assert world.created() == []  # the skipped pool made no sandbox


async def test_usage_shows_a_token_the_idle_time_of_the_sandboxes_its_runs_claimed(
    tmp_path: Path,
) -> None:
    """Each token sees the idle time and cost of the pooled sandboxes its own runs claimed;
    an admin token sees the whole relay's, a sandbox that expired unclaimed included."""
    offset = [0.0]
    settings = memory_settings(
        tmp_path, pool_idle_s=120, cost_rates={"memory": {"vcpu_s": 1.0, "gib_s": 0.0}}
    )
    alice, bob = Principal(name="alice"), Principal(name="bob")
    admin = Principal(name="ops", admin=True)
    async with relay(settings, MemoryWorld(), clock=lambda: time.time() + offset[0]) as service:
        await until(lambda: service.pools.ready == 2)
        rate = service.pools.pools[("warm", "memory")].usd_per_s
        expired = pool_row(
            "expired",
            state=ENDED,
            cpu=0.5,
            memory_mb=512,
            created_at=time.time(),
            expires_at=time.time(),
            idle_s=100.0,
            idle_usd=50.0,
        )
        await service.pools.rows.add(expired, cap=100)
        for principal, idle_s in ((alice, 10.0), (bob, 30.0)):
            offset[0] = idle_s  # both pooled sandboxes were made at 0: idle this long
            request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}})
            submitted, _ = await service.submit(principal, request, None)
            done = await service.wait(submitted.id, 10)
            assert timings(done)["pooled"] is True
        seen = {p.name: (await service.usage(p))[0] for p in (alice, bob, admin)}
    assert seen["alice"].pool_idle_s == pytest.approx(10, abs=1)
    assert seen["alice"].pool_idle_usd == pytest.approx(10 * rate, rel=0.1)
    assert seen["bob"].pool_idle_s == pytest.approx(30, abs=1)
    assert seen["ops"].pool_idle_s == pytest.approx(10 + 30 + 100, abs=2)
    assert seen["ops"].pool_idle_usd == pytest.approx((10 + 30) * rate + 50, rel=0.1)
    assert seen["alice"].usd < 1  # the idle cost is not the token's spend (nor its limits')


async def test_usage_idle_time_adds_up_per_token_on_either_store(
    tmp_path: Path, database_url: str
) -> None:
    """On SQLite and PostgreSQL alike: an idempotent retry claims nothing more, a cold run
    (another size) nothing at all, a token that ran nothing sees nothing, and the tokens'
    shares plus what no run claimed are the admin's figure."""
    offset = [0.0]
    settings = memory_settings(
        tmp_path,
        database_url=database_url,
        pool_idle_s=120,
        cost_rates={"memory": {"vcpu_s": 1.0, "gib_s": 0.0}},
    )
    alice, bob, carol = Principal(name="alice"), Principal(name="bob"), Principal(name="carol")
    admin = Principal(name="ops", admin=True)

    async def send(principal: Principal, key: str | None = None, **body: object) -> RunRecord:
        request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}, **body})
        submitted, _ = await service.submit(principal, request, key)
        return await service.wait(submitted.id, 10)

    async with relay(settings, MemoryWorld(), clock=lambda: time.time() + offset[0]) as service:
        await until(lambda: service.pools.ready == 2)
        offset[0] = 10.0
        first = await send(alice, "same")
        assert timings(first)["pooled"] is True
        assert (await send(alice, "same")).id == first.id  # the retry is the same run
        assert timings(await send(alice, size=Size.medium))["pooled"] is False
        offset[0] = 20.0
        assert timings(await send(bob))["pooled"] is True
        seen = {p.name: (await service.usage(p))[0] for p in (alice, bob, carol)}
        relay_wide = (await service.usage(admin))[0]
        unclaimed = sa.select(
            sa.func.coalesce(sa.func.sum(pooled.c.idle_s), 0.0),
            sa.func.coalesce(sa.func.sum(pooled.c.idle_usd), 0.0),
        ).where(pooled.c.run_id.is_(None))
        nobody = await service.store.read(lambda conn: conn.execute(unclaimed).one())
    assert seen["alice"].pool_idle_s == pytest.approx(10, abs=1)
    assert seen["bob"].pool_idle_s == pytest.approx(20, abs=1)
    assert (seen["carol"].pool_idle_s, seen["carol"].pool_idle_usd) == (0.0, 0.0)
    for field, index in (("pool_idle_s", 0), ("pool_idle_usd", 1)):
        shares = getattr(seen["alice"], field) + getattr(seen["bob"], field) + nobody[index]
        assert getattr(relay_wide, field) == pytest.approx(shares)


async def test_idle_time_is_never_negative_when_the_ending_clock_is_behind(
    database_url: str,
) -> None:
    """Replicas' clocks differ: the one claiming or ending a row may read a time before its
    creation. Its idle time and cost then read 0, never a negative figure in /v1/usage."""
    store = await Store.open(database_url)
    try:
        rows, now = PoolRows(store), time.time()
        for name in ("claimed", "ended"):
            record = pool_row(
                name,
                sandbox_id="box-" + name,
                created_at=now + 30,  # the creator's clock is 30 s ahead of this replica's
                expires_at=now + 300,
            )
            await rows.add(record, cap=100)
        assert await rows.claim("one", "s", "run_skewed", now, 0.01) is not None
        assert await rows.end(POOL_PREFIX + "ended", now, 0.01)
        found = await rows.by_id([POOL_PREFIX + "claimed", POOL_PREFIX + "ended"])
        assert {(row.idle_s, row.idle_usd) for row in found.values()} == {(0.0, 0.0)}
        assert await rows.idle_since(0) == (0.0, 0.0)
    finally:
        await store.close()


class HangingExtension(MemoryProvider):
    """A memory provider whose lifetime extension never answers (a slow provider API)."""

    def __init__(self, settings: Settings, world: MemoryWorld) -> None:
        super().__init__(settings, world)
        self.extending = asyncio.Event()

    async def extend_lifetime(self, sandbox_id: str, lifetime_s: int) -> None:
        self.extending.set()
        await asyncio.Event().wait()


async def test_a_run_canceled_while_its_claim_is_extended_ends_the_pooled_sandbox(
    tmp_path: Path,
) -> None:
    """The claim is written, the sandbox no longer the pool's and not yet the run's: a cancel
    then must still terminate it and end its row (it was left alive to its lifetime)."""
    world = MemoryWorld()
    settings = memory_settings(tmp_path, warm=1)
    async with relay(settings, world, provider=HangingExtension) as service:
        await until(lambda: service.pools.ready == 1)
        (box_id,) = world.alive()
        provider = service.providers["memory"]
        assert isinstance(provider, HangingExtension)
        request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}})
        submitted, _ = await service.submit(PRINCIPAL, request, None)
        await until(provider.extending.is_set)
        canceled = await service.cancel(PRINCIPAL, submitted.id)
        assert canceled.state == "canceled"
        assert not world.boxes[box_id].alive
        assert world.boxes[box_id].ended_by == "run"
        row = (await PoolRows(service.store).by_id([world.boxes[box_id].run_id])).popitem()[1]
        assert row.state == ENDED and row.run_id == submitted.id


class ClaimAnsweredLate(PoolRows):
    """Pool rows whose claim is written, then answered late (a busy store)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.written = asyncio.Event()

    async def claim(
        self, holder: str, shape: str, run_id: str, now: float, usd_per_s: float
    ) -> PoolRecord | None:
        record = await super().claim(holder, shape, run_id, now, usd_per_s)
        self.written.set()
        await asyncio.sleep(0.3)
        return record


async def test_a_run_canceled_while_its_claim_is_written_ends_the_pooled_sandbox(
    tmp_path: Path,
) -> None:
    """A cancel arriving with the store's answer to the claim: the claimed sandbox was left
    among the ready ones, alive, its row claimed (never expired nor drained), the pool one
    short for good. It is terminated, its row ended, and the pool refilled."""
    world = MemoryWorld()
    async with relay(memory_settings(tmp_path, warm=1), world) as service:
        pools = service.pools
        await until(lambda: pools.ready == 1)
        (box_id,) = world.alive()
        rows = pools.rows = ClaimAnsweredLate(service.store)
        request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}})
        submitted, _ = await service.submit(PRINCIPAL, request, None)
        await until(rows.written.is_set)
        canceled = await service.cancel(PRINCIPAL, submitted.id)
        assert canceled.state == "canceled"
        await until(lambda: not world.boxes[box_id].alive, 2)
        row = (await rows.by_id([world.boxes[box_id].run_id])).popitem()[1]
        assert row.state == ENDED and row.run_id == submitted.id
        await until(lambda: pools.ready == 1 and box_id not in world.alive(), 2)


class ClaimAnsweredWithAnError(PoolRows):
    """Pool rows whose claim is written, then answered with an error (a lost connection)."""

    async def claim(
        self, holder: str, shape: str, run_id: str, now: float, usd_per_s: float
    ) -> PoolRecord | None:
        await super().claim(holder, shape, run_id, now, usd_per_s)
        raise ConnectionResetError("the store's answer was lost")


async def test_a_claim_written_but_answered_with_an_error_does_not_keep_its_sandbox(
    tmp_path: Path,
) -> None:
    """The run goes cold; the sandbox its claim took was kept among the ready ones past its
    idle time (its row claimed: never expired, never claimed again), alive, the pool one
    short for good. At its idle time it is terminated and the pool refilled."""
    world = MemoryWorld()
    settings = memory_settings(tmp_path, warm=1, pool_idle_s=0.5)
    async with relay(settings, world) as service:
        pools = service.pools
        await until(lambda: pools.ready == 1)
        (box_id,) = world.alive()
        pools.rows = ClaimAnsweredWithAnError(service.store)
        done = await run(service, files={"secret.txt": "x"})
        assert done.state == "succeeded" and timings(done)["pooled"] is False
        pools.rows = PoolRows(service.store)
        await until(lambda: not world.boxes[box_id].alive, 3)
        await until(lambda: pools.ready == 1 and box_id not in world.alive(), 3)


async def test_a_claim_answered_with_an_error_leaves_nothing_alive_at_shutdown(
    tmp_path: Path,
) -> None:
    """The drain ended only the ready rows' sandboxes: one whose claim was written but
    answered with an error stayed alive behind the relay."""
    world = MemoryWorld()
    async with relay(memory_settings(tmp_path, warm=1, pool_idle_s=60), world) as service:
        pools = service.pools
        await until(lambda: pools.ready == 1)
        (box_id,) = world.alive()
        pools.rows = ClaimAnsweredWithAnError(service.store)
        done = await run(service, files={"secret.txt": "x"})
        assert done.state == "succeeded" and timings(done)["pooled"] is False
        pools.rows = PoolRows(service.store)
    assert not world.boxes[box_id].alive


async def test_an_extension_that_never_answers_goes_cold_within_the_create_timeout(
    tmp_path: Path,
) -> None:
    """Nothing bounded the lifetime extension at claim: a provider API that never answered
    held the run `starting` for good (the reaper leaves the runs a relay holds). It is
    bounded as the create it replaces; the run goes cold, the pooled sandbox ended."""
    world = MemoryWorld()
    settings = memory_settings(tmp_path, warm=1, create_timeout_s=0.5)
    async with relay(settings, world, provider=HangingExtension) as service:
        await until(lambda: service.pools.ready == 1)
        (box_id,) = world.alive()
        request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}})
        submitted, _ = await service.submit(PRINCIPAL, request, None)
        done = await service.wait(submitted.id, 3)
        assert done.state == "succeeded" and timings(done)["pooled"] is False
        assert not world.boxes[box_id].alive


async def test_a_sandbox_expired_while_its_claim_is_written_leaves_no_claimed_row(
    tmp_path: Path,
) -> None:
    """The expiry finds the row claimed and ends the sandbox; the claim, answered then,
    goes cold. Its row stayed `claimed` for good (its sandbox gone, nobody to end it)."""
    world = MemoryWorld()
    now = [time.time()]
    settings = memory_settings(tmp_path, warm=1, pool_idle_s=60)
    async with relay(settings, world, clock=lambda: now[0]) as service:
        pools = service.pools
        await until(lambda: pools.ready == 1)
        (box_id,) = world.alive()
        pool_id = world.boxes[box_id].run_id
        rows = pools.rows = ClaimAnsweredLate(service.store)
        request = RunRequest.model_validate({"job": "warm", "files": {"secret.txt": "x"}})
        submitted, _ = await service.submit(PRINCIPAL, request, None)
        await until(rows.written.is_set)
        now[0] += 61
        await pools._expire()
        assert not world.boxes[box_id].alive
        done = await service.wait(submitted.id, 3)
        assert done.state == "succeeded" and timings(done)["pooled"] is False
        row = (await rows.by_id([pool_id])).popitem()[1]
        assert row.state == ENDED
