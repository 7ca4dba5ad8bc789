"""Per-provider caps of runs at once (``RELAY_<NAME>_MAX_CONCURRENT``; relay/runs/capacity.py,
relay/store/limits.py): a provider at its cap is skipped by a route while another can take
the run, a route with none free is a 429 naming them, and the count is the store's, so it
holds across replicas.

Two memory worlds (the shipped memory provider over each) enabled as ``memory`` and ``local``
(a cap knows a provider by its name: ``RELAY_LOCAL_MAX_CONCURRENT``), routed in that order by
``RELAY_ROUTE``; real SQLite and PostgreSQL, the real run service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relay.errors import RateLimited
from relay.providers.contract import Provider
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import RunState
from relay.runs.capacity import Capacity, caps_of
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.runs.view import run_model
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.chaos import PRINCIPAL
from tests.conftest import make_settings, new_database

ROUTE = ["memory", "local"]


class SecondWorld(MemoryProvider):
    """The memory provider under the second name (its sandboxes say so)."""

    name = "local"


@contextlib.asynccontextmanager
async def replica(
    tmp_path: Path, database_url: str, worlds: dict[str, MemoryWorld], **values: Any
) -> AsyncIterator[RunService]:
    """One relay's run service over the worlds, on the shared database."""
    settings = make_settings(
        tmp_path,
        database_url=database_url,
        providers=ROUTE,
        route=ROUTE,
        grace_s=5,
        max_concurrent=1000,
        token_share=1,
        **values,
    )
    providers: dict[str, Provider] = {
        "memory": MemoryProvider(settings, worlds["memory"]),
        "local": SecondWorld(settings, worlds["local"]),
    }
    store = await Store.open(settings.database_url)
    service = RunService(settings, store, Catalog({}), providers)
    try:
        yield service
    finally:
        await service.shutdown()
        for provider in providers.values():
            await provider.aclose()
        await store.close()


async def submitted(service: RunService, *argv: str) -> RunRecord:
    run, _ = await service.submit(PRINCIPAL, RunRequest(command=list(argv)), None)
    return run


class Peak:
    """The most sandboxes a world had alive at once, sampled while it runs."""

    def __init__(self, world: MemoryWorld) -> None:
        self.world, self.most = world, 0
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            self.most = max(self.most, len(self.world.alive()))
            await asyncio.sleep(0.002)

    async def stop(self) -> int:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return self.most


@pytest.mark.postgres
async def test_two_replicas_never_run_more_than_a_providers_cap_on_it(
    tmp_path: Path, postgres_url: str
) -> None:
    url = await new_database(postgres_url)
    worlds = {"memory": MemoryWorld(), "local": MemoryWorld()}
    async with (
        replica(tmp_path / "a", url, worlds, memory_max_concurrent=1) as first,
        replica(tmp_path / "b", url, worlds, memory_max_concurrent=1) as second,
    ):
        peak = Peak(worlds["memory"])
        runs = await asyncio.gather(
            *(submitted(service, "sleep", "0.3") for service in [first, second] * 4)
        )
        ended = [await (first if i % 2 == 0 else second).wait(r.id, 30) for i, r in enumerate(runs)]
        most = await peak.stop()
    assert all(run.state is RunState.succeeded for run in ended), [r.error_message for r in ended]
    on = [run.provider for run in ended]
    assert most == 1, f"{most} runs at once on a provider capped at 1"
    assert on.count("memory") >= 1 and on.count("local") >= 4, on
    # Placed at the admission: no attempt on the full provider, none failed.
    for run in ended:
        assert [a.provider for a in run_model(run).attempts if a.error] == []


async def test_a_route_with_every_provider_at_its_cap_is_a_429_naming_them(
    tmp_path: Path, database_url: str
) -> None:
    worlds = {"memory": MemoryWorld(), "local": MemoryWorld()}
    caps = {"memory_max_concurrent": 1, "local_max_concurrent": 1}
    async with replica(tmp_path, database_url, worlds, **caps) as service:
        held = [await submitted(service, "sleep", "5") for _ in range(2)]
        assert [run.provider for run in held] == ["memory", "local"]
        with pytest.raises(RateLimited) as refused:
            await submitted(service, "echo", "one too many")
        assert refused.value.status == 429 and refused.value.retry_after
        assert "memory (1 at once)" in refused.value.message
        assert "local (1 at once)" in refused.value.message
        for run in held:
            await service.cancel(PRINCIPAL, run.id)
        # A slot freed: the next run is admitted again, on the first provider.
        again = await submitted(service, "echo", "room")
        assert again.provider == "memory"
        assert (await service.wait(again.id, 30)).state is RunState.succeeded


async def test_a_failover_moves_the_runs_count_and_skips_a_provider_at_its_cap(
    tmp_path: Path, database_url: str
) -> None:
    worlds = {"memory": MemoryWorld(), "local": MemoryWorld()}
    async with replica(tmp_path, database_url, worlds, local_max_concurrent=1) as service:
        worlds["memory"].faults.create_status = 503
        holder = await submitted(service, "sleep", "5")
        assert holder.provider == "memory"  # placed on the first: memory has no cap
        await _until(lambda: bool(worlds["local"].alive()))
        # Its failover moved its count to local (a conditional update under the lock).
        stored = await service.store.get_run(holder.id)
        assert stored is not None and stored.provider == "local"
        refused = await service.wait((await submitted(service, "echo", "x")).id, 30)
        assert refused.state is RunState.error
        # local was skipped (its cap), not attempted: one attempt, memory's.
        assert [a.provider for a in run_model(refused).attempts] == ["memory"]
        assert refused.error_message is not None
        assert "local: at its cap of 1 runs at once" in refused.error_message
        assert len(worlds["local"].created()) == 1
        await service.cancel(PRINCIPAL, holder.id)


async def test_no_cap_means_no_store_work_for_one() -> None:
    class NoStore:
        async def move_run(self, run_id: str, to: str, cap: int | None) -> bool:
            raise AssertionError("the store was asked with no provider capped")

    capacity = Capacity({}, NoStore())
    assert await capacity.take("run_a", "memory", "local")
    assert await Capacity({"daytona": 2}, NoStore()).take("run_a", "memory", "local")


async def _until(check: Any, within_s: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check():
        assert loop.time() < deadline
        await asyncio.sleep(0.01)


def test_a_cloud_providers_cap_is_in_its_own_settings(tmp_path: Path) -> None:
    from relay.providers.e2b import E2BProvider

    class Cloud:
        settings_model = E2BProvider.settings_model

    settings = make_settings(tmp_path, e2b_max_concurrent=3, local_max_concurrent=2)
    caps = caps_of(settings, {"e2b": Cloud(), "local": SecondWorld(settings)})  # type: ignore[dict-item]
    assert caps == {"e2b": 3, "local": 2}
    assert caps_of(make_settings(tmp_path), {"e2b": Cloud()}) == {}  # type: ignore[dict-item]
