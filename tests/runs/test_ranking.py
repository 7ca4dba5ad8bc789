"""Route choice (relay/runs/ranking.py): a job's ``route = "order" | "fastest" | "cheapest"``
(``RELAY_ROUTE_CHOICE`` where it names none) orders its providers before they are tried;
``fastest`` by the relay's own recent create times, read from the store at most every
``RELAY_ROUTE_LATENCY_REFRESH_S`` and shown on ``/v1/health``; ``cheapest`` by the rates.

Two memory worlds enabled as ``memory`` and ``local`` (tests/runs/test_capacity.py says why);
real SQLite, the real run service and app.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.errors import ConfigError
from relay.http.app import create_app
from relay.providers.contract import Provider
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import RunState
from relay.runs.catalog import Catalog
from relay.runs.service import RunService
from relay.token_file import new_token
from tests.conftest import make_settings
from tests.runs.test_capacity import SecondWorld

JOB = """
command = ["echo", "ranked"]
providers = ["memory", "local"]
{route}
"""


def _jobs(tmp_path: Path, route: str) -> Path:
    root = tmp_path / "jobs"
    (root / "ranked").mkdir(parents=True, exist_ok=True)
    (root / "ranked" / "job.toml").write_text(JOB.format(route=route))
    return root


@contextlib.asynccontextmanager
async def relay(
    tmp_path: Path, worlds: dict[str, MemoryWorld], route: str = "", **values: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str], RunService]]:
    """A whole relay in process: a client, an admin token's headers, its run service."""
    settings = make_settings(
        tmp_path,
        jobs_dir=_jobs(tmp_path, route),
        providers=["memory", "local"],
        grace_s=5,
        **values,
    )
    token = new_token(settings.tokens_file, "ops", command=True, jobs=["ranked"], admin=True)
    providers: dict[str, Provider] = {
        "memory": MemoryProvider(settings, worlds["memory"]),
        "local": SecondWorld(settings, worlds["local"]),
    }
    app = create_app(settings, providers=providers)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
            yield client, {"Authorization": f"Bearer {token}"}, app.state.relay.service


async def _ran_on(client: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> str:
    answer = await client.post("/v1/runs", json={"wait": True, **body}, headers=headers)
    assert answer.status_code in (200, 201), answer.text
    run = answer.json()
    assert run["state"] == RunState.succeeded, run
    return str(run["provider"])


def test_a_jobs_route_is_one_of_the_three_choices(tmp_path: Path) -> None:
    for choice in ("order", "fastest", "cheapest"):
        catalog = Catalog.load(_jobs(tmp_path / choice, f'route = "{choice}"'))
        assert catalog.jobs["ranked"].route == choice
    with pytest.raises(ConfigError, match="route: must be one of order, fastest, cheapest"):
        Catalog.load(_jobs(tmp_path / "bad", 'route = "quickest"'))


async def test_cheapest_tries_the_provider_whose_rates_cost_the_run_least(tmp_path: Path) -> None:
    worlds = {"memory": MemoryWorld(), "local": MemoryWorld()}
    rates = {"memory": {"vcpu_s": 0.01, "gib_s": 0.0}, "local": {"vcpu_s": 0.001, "gib_s": 0.0}}
    async with relay(tmp_path, worlds, 'route = "cheapest"', cost_rates=rates) as (c, h, _):
        assert await _ran_on(c, h, job="ranked") == "local"
    # The same rates: a tie keeps the written order.
    same = {"memory": rates["local"], "local": rates["local"]}
    async with relay(tmp_path / "tie", worlds, 'route = "cheapest"', cost_rates=same) as (
        c,
        h,
        _,
    ):
        assert await _ran_on(c, h, job="ranked") == "memory"


async def test_fastest_ranks_by_the_relays_recent_creates_read_in_batches(
    tmp_path: Path,
) -> None:
    worlds = {"memory": MemoryWorld(), "local": MemoryWorld()}
    worlds["memory"].faults.create_delay_s = 0.2
    async with relay(tmp_path, worlds, route_choice="fastest") as (client, headers, service):
        reads: list[float] = []
        read = service.ranking.read_latencies

        async def counted(since: float) -> dict[str, int]:
            reads.append(since)
            return await read(since)

        service.ranking.read_latencies = counted
        now = [0.0]
        service.ranking.clock = lambda: now[0]  # RELAY_ROUTE_LATENCY_REFRESH_S passes at will
        # Nothing measured yet: the written order (RELAY_ROUTE: the enabled providers).
        command = {"command": ["echo", "ranked"]}
        assert await _ran_on(client, headers, **command) == "memory"
        assert await _ran_on(client, headers, **command, provider="local") == "local"
        assert len(reads) == 1  # the first run asked (nothing known), in the background
        now[0] += service.settings.route_latency_refresh_s
        health = (await client.get("/v1/health", headers=headers)).json()
        p50 = {p["name"]: p["create_p50_ms"] for p in health["providers"]}
        assert p50["memory"] >= 200 and p50["local"] < 100, p50
        # Now local is the faster: a run the job leaves to the relay's choice goes there, and
        # neither it nor the next read the store again (within the refresh time).
        before = len(reads)
        assert await _ran_on(client, headers, **command) == "local"
        assert await _ran_on(client, headers, **command) == "local"
        assert len(reads) == before
        assert await _ran_on(client, headers, job="ranked") == "local"
    # On the same database, a job that says `route = "order"` keeps its order all the same.
    same = {"database_url": f"sqlite:///{tmp_path / 'relay.db'}", "route_choice": "fastest"}
    async with relay(tmp_path / "order", worlds, 'route = "order"', **same) as (c, h, service):
        assert await service.ranking.fresh() == p50
        assert await _ran_on(c, h, job="ranked") == "memory"
