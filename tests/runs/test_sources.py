"""Sandbox sources (relay/runs/sources.py): a run opens one door, a provider or a provider
behind its warm pools, and records where its sandbox came from as the sandbox says."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from relay.auth import Principal
from relay.providers.contract import Provenance, Sandbox, SandboxSpec
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import RunState
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.runs.sources import PooledSource
from relay.store.database import Store
from tests.runs.test_pools import memory_settings, until

PRINCIPAL = Principal(name="pooler", command=True)
E2B_VCPU_S = 0.5  # USD per vCPU-second, to see which provider a run was counted at


class Elsewhere:
    """A source of the provider's shape that says its sandbox came from E2B, warm, made
    (and billed) five seconds ago: what a route over several pooled providers may say."""

    def __init__(self, inner: MemoryProvider) -> None:
        self.inner = inner

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        async with self.inner.sandbox(spec) as box:
            box.provenance = Provenance("e2b", time.monotonic() - 5.0, pooled=True)
            yield box


async def test_a_run_is_counted_where_and_from_when_its_sandbox_says(tmp_path: Path) -> None:
    settings = memory_settings(
        tmp_path, warm=0, cost_rates={"e2b": {"vcpu_s": E2B_VCPU_S, "gib_s": 0.0}}
    )
    store = await Store.open(settings.database_url)
    provider = MemoryProvider(settings, MemoryWorld())
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), {"memory": provider})
    service.runner.sources = {"memory": Elsewhere(provider)}
    try:
        request = RunRequest(command=["echo", "hi"])
        submitted, _ = await service.submit(PRINCIPAL, request, None)
        done = await service.wait(submitted.id, 10)
    finally:
        await service.shutdown()
        await store.close()
    assert done.state is RunState.succeeded and done.stdout == "hi\n"
    assert json.loads(done.timings)["pooled"] is True
    assert 5.0 <= done.sandbox_s < 10.0
    assert done.cost_usd == round(done.sandbox_s * E2B_VCPU_S, 9)  # one vCPU, at E2B's rate


async def test_a_provider_with_a_pool_is_behind_its_pool_and_one_without_is_its_own_door(
    tmp_path: Path,
) -> None:
    settings = memory_settings(tmp_path, warm=1)
    store = await Store.open(settings.database_url)
    pooled, plain = MemoryProvider(settings, MemoryWorld()), MemoryProvider(settings, MemoryWorld())
    providers = {"memory": pooled, "plain": plain}
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), providers)
    try:
        door = service.runner.sources["memory"]
        assert isinstance(door, PooledSource) and door.provider is pooled
        assert service.runner.sources["plain"] is plain
        service.start()
        await until(lambda: service.pools.ready == 1)
        (pool,) = service.pools.pools.values()
        spec = replace(service.pools.spec(pool, "run_warm"), timeout_s=5.0)
        async with door.sandbox(replace(spec, job=None, run_id="run_raw")) as cold:
            assert not cold.provenance.pooled  # a raw command never takes a job's sandbox
        async with door.sandbox(spec) as warm:
            assert warm.provenance == Provenance("memory", warm.provenance.billed_from, True)
            assert warm.provenance.billed_from > cold.provenance.billed_from
    finally:
        await service.shutdown()
        await store.close()
