"""Warm pools on every cloud provider's real SDK against its protocol-level fake: a pooled
sandbox serves one run (a file of run 1 is never seen by run 2), the pool refills, the
lifetime is extended at claim where the provider can (E2B's ``set_timeout``) and capped where
it cannot, and shutdown leaves nothing alive in the fake's ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.providers.contract import Provider
from relay.providers.registry import load_provider
from relay.runs.catalog import Catalog
from relay.runs.service import RunService
from relay.store.database import Store
from testing.chaos import fake_backend
from testing.rigs import ON_FAKES
from tests.conftest import make_settings
from tests.runs.test_pools import run, timings, write_job

IDLE_S = 40
TIMEOUT_S = 5
GRACE_S = 5


async def until(check: Callable[[], bool], within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("name", ON_FAKES)
async def test_a_pool_on_each_providers_fake(name: str, tmp_path: Path) -> None:
    with fake_backend(name, tmp_path) as backend:
        settings = make_settings(
            tmp_path,
            jobs_dir=write_job(tmp_path / "jobs", 1),
            grace_s=GRACE_S,
            pool_idle_s=IDLE_S,
            **backend.settings,  # the fake's rig: its provider, keys and URLs
        )
        store = await Store.open(settings.database_url)
        provider = load_provider(name, settings)
        providers: dict[str, Provider] = {name: provider}
        service = RunService(settings, store, Catalog.load(settings.jobs_dir), providers)
        service.start()
        try:
            await until(lambda: service.pools.ready == 1)
            (pooled,) = backend.alive()
            first = await run(service, files={"secret.txt": "run one's secret"})
            assert timings(first)["pooled"] is True and first.sandbox_id == pooled
            assert (first.state, first.stdout) == ("succeeded", "run one's secret")
            await until(lambda: service.pools.ready == 1)  # refilled
            second = await run(service)
            assert timings(second)["pooled"] is True and second.sandbox_id != pooled
            assert second.state == "failed" and "secret" not in second.stdout
            if name == "e2b":  # created for idle + grace, given the run's lifetime at claim
                ledger = backend.fake.ledger
                assert int(ledger.create_of(pooled)["timeout"]) == IDLE_S + GRACE_S
                assert [t for box, t in ledger.timeouts if box == pooled] == [TIMEOUT_S + GRACE_S]
        finally:
            await service.shutdown()
            await provider.aclose()
            await store.close()
        assert backend.alive() == set(), "a pooled sandbox outlived the relay's shutdown"
