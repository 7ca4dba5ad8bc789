"""A relay that shuts down while a pooled sandbox's create has just returned (its row not
yet marked ready), or while its store is away, terminates that sandbox too: none outlives
the relay."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from relay.providers.contract import Provider
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.runs.catalog import Catalog
from relay.runs.service import RunService
from relay.store.database import Store
from relay.store.pools import PoolRows
from tests.runs.test_pools import memory_settings, until


class SlowMarks(PoolRows):
    """The store a little slow to mark a created sandbox ready (a busy database)."""

    async def mark_ready(self, pool_id: str, sandbox_id: str) -> bool:
        await asyncio.sleep(0.3)
        return await super().mark_ready(pool_id, sandbox_id)


async def test_a_sandbox_created_as_the_relay_drains_is_terminated(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path, warm=1)
    world = MemoryWorld()
    store = await Store.open(settings.database_url)
    providers: dict[str, Provider] = {"memory": MemoryProvider(settings, world)}
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), providers)
    service.pools.rows = SlowMarks(store)
    service.start()
    try:
        await until(lambda: len(world.created()) == 1)  # created; its row not marked yet
    finally:
        await service.shutdown()
        await store.close()
    assert world.alive() == set()


class StoreAway(PoolRows):
    """PostgreSQL stopped just before the SIGTERM: a pooled row cannot be ended."""

    async def end(self, *args: Any, **kwargs: Any) -> bool:
        raise ConnectionRefusedError(111, "Connection refused")


async def test_a_store_away_at_shutdown_still_terminates_the_pool(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path, warm=2)
    world = MemoryWorld()
    store = await Store.open(settings.database_url)
    providers: dict[str, Provider] = {"memory": MemoryProvider(settings, world)}
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), providers)
    service.start()
    try:
        await until(lambda: service.pools.ready == 2)
        service.pools.rows = StoreAway(store)
        await service.shutdown()  # does not raise: the rest of the shutdown runs
    finally:
        await store.close()
    assert world.alive() == set()
