"""Per-token limits, the cluster-wide cap, spend budgets and cost, each at its edge.

The service runs for real (local provider, real store on SQLite and PostgreSQL) with an
injected clock, so a day can roll over inside a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.auth import Principal
from relay.errors import BudgetExceeded, RateLimited
from relay.providers.e2b import E2BProvider
from relay.providers.local.provider import LocalProvider
from relay.providers.modal import ModalProvider
from relay.providers.vercel import VercelProvider
from relay.runs.catalog import Catalog
from relay.runs.costs import CostModel
from relay.runs.models import SIZES, RunRequest, Size
from relay.runs.service import RunService
from relay.store.database import Store
from relay.store.limits import Admission, LimitReached, day_start
from testing.relay_server import RelayProcess
from testing.rows import run_row
from tests.conftest import REPO, make_settings

PROVIDER_CLASSES: dict[str, Any] = {
    provider.name: provider
    for provider in (LocalProvider, E2BProvider, ModalProvider, VercelProvider)
}
"""CostModel reads only ``rate``, which each provider class carries."""

DAY = 86_400.0


@dataclass
class Clock:
    now: float = 20_000 * DAY + 3600.0  # 01:00 UTC on some day

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    service: RunService
    clock: Clock


@pytest.fixture
async def rig(tmp_path: Path, database_url: str) -> AsyncIterator[Rig]:
    # Each token may take every slot here (token_share 1): these tests are of the other
    # limits; the fair share has its own rig.
    async with service_rig(tmp_path, database_url, max_concurrent=3, token_share=1.0) as made:
        yield made


@pytest.fixture
async def shared_rig(tmp_path: Path, database_url: str) -> AsyncIterator[Rig]:
    async with service_rig(tmp_path, database_url, max_concurrent=4) as made:
        yield made


@contextlib.asynccontextmanager
async def service_rig(tmp_path: Path, database_url: str, **values: Any) -> AsyncIterator[Rig]:
    settings = make_settings(
        tmp_path,
        database_url=database_url,
        local_isolation="bwrap",
        drain_s=0,
        cost_rates={"local": {"vcpu_s": 0.01, "gib_s": 0.0}},
        **values,
    )
    store = await Store.open(database_url)
    clock = Clock()
    local = LocalProvider(settings)
    service = RunService(
        settings, store, Catalog.load(REPO / "jobs"), {"local": local}, clock=clock
    )
    yield Rig(service, clock)
    await service.shutdown()  # drain_s is 0: cancel what is left without waiting
    await local.aclose()  # and wait for every child it started, before the loop ends
    await store.close()


def sleeper(seconds: float = 30, timeout_s: float | None = None) -> RunRequest:
    return RunRequest(command=["sleep", str(seconds)], wait=False, timeout_s=timeout_s)


def token(name: str, **limits: float) -> Principal:
    return Principal(name=name, command=True, **limits)  # type: ignore[arg-type]


async def test_runs_per_day_at_its_edge_and_after_midnight(rig: Rig) -> None:
    principal = token("daily", runs_per_day=3)
    for _ in range(3):
        run, _ = await rig.service.submit(principal, RunRequest(command=["true"]), None)
        assert (await rig.service.wait(run.id, 60)).state == "succeeded"
    with pytest.raises(RateLimited) as refused:
        await rig.service.submit(principal, RunRequest(command=["true"]), None)
    assert refused.value.code == "rate_limited" and refused.value.status == 429
    headers = refused.value.response_headers()
    until_midnight = round(day_start(rig.clock.now) + DAY - rig.clock.now)
    assert headers["Retry-After"] == str(until_midnight)
    assert headers["RateLimit-Policy"] == f'"runs-day";q=3;w={DAY:.0f}'
    assert headers["RateLimit"] == f'"runs-day";r=0;t={until_midnight}'
    rig.clock.now = day_start(rig.clock.now) + DAY + 1  # the next day
    await rig.service.submit(principal, RunRequest(command=["true"]), None)


async def test_concurrent_requests_race_for_the_last_slots(rig: Rig) -> None:
    principal = token("racer", max_concurrent=2)
    results = await asyncio.gather(
        *(rig.service.submit(principal, sleeper(), None) for _ in range(8)),
        return_exceptions=True,
    )
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 2 and len(refused) == 6
    assert all(r.retry_after is not None and r.retry_after > 1 for r in refused)
    await rig.service.cancel(principal, admitted[0][0].id)
    await rig.service.submit(principal, sleeper(), None)  # a slot came free


async def test_the_cluster_cap_holds_across_tokens(rig: Rig) -> None:
    results = await asyncio.gather(
        *(rig.service.submit(token(f"t{i % 4}"), sleeper(), None) for i in range(10)),
        return_exceptions=True,
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 3  # RELAY_MAX_CONCURRENT
    assert all(isinstance(r, RateLimited) for r in results if isinstance(r, BaseException))


async def test_a_token_without_its_own_limit_holds_its_fair_share_and_no_more(
    shared_rig: Rig,
) -> None:
    """Issue 34: one token with no max_concurrent took every slot, and another token's run
    got 429 until they ended. Now it holds half of RELAY_MAX_CONCURRENT (4 here)."""
    service, busy = shared_rig.service, token("busy")
    results = await asyncio.gather(
        *(service.submit(busy, sleeper(), None) for _ in range(4)), return_exceptions=True
    )
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(admitted) == 2 and len(refused) == 2, results
    assert "this token's share of the relay's 4" in refused[0].message
    assert refused[0].retry_after is not None and refused[0].retry_after >= 1
    other, _ = await service.submit(token("other"), sleeper(), None)  # room is left
    await service.cancel(busy, admitted[0][0].id)
    await service.submit(busy, sleeper(), None)  # its slot came free
    for run, _ in admitted[1:]:
        await service.cancel(busy, run.id)
    await service.cancel(token("other"), other.id)
    # A token's own max_concurrent wins over the share, up to the relay's limit.
    trusted = token("trusted", max_concurrent=4)
    for _ in range(3):
        await service.submit(trusted, sleeper(), None)


async def test_idempotent_retry_is_not_refused_by_its_own_slot(rig: Rig) -> None:
    principal = token("retry", max_concurrent=1)
    first, created = await rig.service.submit(principal, sleeper(), "key-1")
    again, created_again = await rig.service.submit(principal, sleeper(), "key-1")
    assert created and not created_again and again.id == first.id


async def test_budget_reserves_the_worst_case_then_records_the_actual(rig: Rig) -> None:
    # local is priced at $0.01 per vCPU-second here; a small run is 1 vCPU. A run is billed
    # for its sandbox's life, which outlasts its 1 s timeout by its start and its end (a
    # tenth of a second alone, more on a loaded machine): the day's limit leaves the two
    # runs that room past their reservations, and is still short of a third reservation.
    principal = token("spender", usd_per_day=0.0299)
    told: dict[str, str] = {}
    first, _ = await rig.service.submit(principal, sleeper(30, timeout_s=1), None, told)
    # Whole cents, as the field needs an integer: $0.0299 is told as 2, $0.0199 left as 1.
    assert told["RateLimit-Policy"] == f'"usd-day";q=2;qu="usd-cents";w={DAY:.0f}'
    assert told["RateLimit"].startswith('"usd-day";r=1;t=')
    second, _ = await rig.service.submit(principal, sleeper(30, timeout_s=1), None)
    assert first.reserved_usd == pytest.approx(0.01)
    with pytest.raises(BudgetExceeded) as refused:  # 0.01 + 0.01 + 0.01 > 0.0299
        await rig.service.submit(principal, sleeper(30, timeout_s=1), None)
    assert refused.value.code == "budget_exceeded"
    assert refused.value.response_headers()["RateLimit"].startswith('"usd-day";r=0;t=')
    done = [await rig.service.wait(r.id, 15) for r in (first, second)]
    for run in done:
        assert run.state == "timed_out"
        assert run.cost_usd == pytest.approx(run.sandbox_s * 0.01, abs=1e-6)
        assert 1.0 <= run.sandbox_s < 5
    today, month = await rig.service.usage(principal)
    assert today.runs == 2 and today.active == 0 and month.usd == today.usd
    assert today.usd == pytest.approx(sum(r.cost_usd for r in done))
    # The actual cost replaced the reservation (both counted would pass $0.04): room now.
    assert today.usd < 0.0289
    await rig.service.submit(principal, RunRequest(command=["true"], timeout_s=0.1), None)


async def test_runs_this_replica_knows_ended_count_as_ended(database_url: str) -> None:
    """Issue 37, item 2: a run whose final write has not landed (the store down a moment
    ago) but whose outcome the admitting replica knows (``settled``, with its cost) holds
    no slot and counts at its cost, not its reservation, in the same transaction, on both
    engines; one the store has final already is not taken off twice."""
    store = await Store.open(database_url)
    try:
        now = time.time()
        for number in range(3):
            await store.admit_run(run_row(f"run_busy{number}", reserved_usd=0.5))
        limits = Admission(
            token_concurrent=3, global_concurrent=3, runs_per_day=None, usd_per_day=1.2, now=now
        )
        with pytest.raises(LimitReached):
            await store.admit_run(run_row("run_refused"), limits)
        await store.update_run("run_busy2", state="succeeded", cost_usd=0.1)
        settled = {"run_busy0": 0.05, "run_busy2": 0.1}  # busy2's write landed meanwhile
        standing = await store.admit_run(
            run_row("run_admitted", reserved_usd=0.5), replace(limits, settled=settled)
        )
        assert standing is not None
        assert standing.active == 1  # busy1; busy0 ended here; busy2 ended in the store
        # The day counts busy0 at its cost (0.05), busy1 reserved (0.5), busy2 (0.1).
        assert standing.usd_today == pytest.approx(0.65)
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("provider", "size", "seconds", "expected"),
    [
        ("modal", Size.small, 60, 60 * (1 * 0.00003942 + 1 * 0.00000667)),
        ("modal", Size.large, 3600, 3600 * (4 * 0.00003942 + 8 * 0.00000667)),
        ("e2b", Size.small, 10, 10 * (0.000014 + 0.0000045)),
        ("e2b", Size.medium, 300, 300 * (2 * 0.000014 + 4 * 0.0000045)),
        ("vercel", Size.medium, 100, 100 * (2 * 0.128 / 3600 + 4 * 0.0106 / 3600)),
        ("local", Size.large, 1000, 0.0),
    ],
)
def test_cost_arithmetic(provider: str, size: Size, seconds: float, expected: float) -> None:
    """The rates are read from each provider class (no table of them anywhere else)."""
    cpu, memory_mb, _disk_mb = SIZES[size]
    model = CostModel(PROVIDER_CLASSES)
    assert model.cost(provider, cpu, memory_mb, seconds) == pytest.approx(expected, rel=1e-6)


def test_rates_can_be_overridden() -> None:
    model = CostModel(PROVIDER_CLASSES, {"e2b": {"vcpu_s": 1.0}})
    assert model.cost("e2b", 2, 1024, 3) == pytest.approx(3 * (2 * 1.0 + 0.0000045))


def rate_limit(headers: httpx.Headers) -> dict[str, dict[str, str]]:
    """``RateLimit``/``RateLimit-Policy`` items: name → parameters (a test-sized parser of
    the structured-field lists the relay writes)."""
    items: dict[str, dict[str, str]] = {}
    for item in headers.get_list("ratelimit", split_commas=True):
        name, *parameters = item.strip().split(";")
        assert name.startswith('"') and name.endswith('"'), item
        items[name.strip('"')] = dict(parameter.split("=", 1) for parameter in parameters)
    return items


@pytest.mark.slow  # needs a relay process: seconds
def test_http_rate_limit_fields_on_every_answer(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "r", local_isolation="bwrap")
    limits = {"runs_per_day": 2, "usd_per_day": 1.5, "max_concurrent": 2}
    limited = server.add_token("limited", command=True, limits=limits)
    free = server.add_token("free", command=True)
    server.start()
    try:
        first = server.post(limited, {"command": ["true"]})
        assert first.status_code == 200
        assert first.headers["RateLimit-Policy"] == (
            '"concurrent";q=2;qu="concurrent-requests", "runs-day";q=2;w=86400, '
            '"usd-day";q=150;qu="usd-cents";w=86400'  # $1.5 as whole cents, not 1.5
        )
        left = rate_limit(first.headers)
        until_midnight = left["runs-day"]["t"]
        assert 1 <= int(until_midnight) <= 86_400 and left["usd-day"]["t"] == until_midnight
        assert left == {
            "concurrent": {"r": "1"},  # this run is still counted as running when admitted
            "runs-day": {"r": "1", "t": until_midnight},
            "usd-day": {"r": "150", "t": until_midnight},
        }
        later = server.post(limited, {"command": ["true"], "wait": False})
        assert later.status_code == 202 and rate_limit(later.headers)["runs-day"]["r"] == "0"
        refused = server.post(limited, {"command": ["true"]})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limited"
        assert refused.headers["RateLimit-Policy"] == first.headers["RateLimit-Policy"]
        assert rate_limit(refused.headers)["runs-day"]["r"] == "0"
        assert refused.headers["Retry-After"] == rate_limit(refused.headers)["runs-day"]["t"]
        unlimited = server.post(free, {"command": ["true"]})
        assert unlimited.status_code == 200 and "RateLimit" not in unlimited.headers
        report = httpx.get(server.url + "/v1/usage", headers=server.headers(limited)).json()
        assert report["token"] == "limited" and report["today"]["runs"] == 2
        assert report["limits"]["runs_per_day"] == 2 and report["month"]["runs"] == 2
    finally:
        server.stop()


@pytest.mark.slow  # needs a relay process: seconds
def test_retry_after_of_runs_at_once_is_when_a_run_is_expected_to_end(tmp_path: Path) -> None:
    """A run of a job that takes ~1 s holds the only slot: come back in ~1 s, not at its
    deadline (the create timeout plus its timeout, here 40 s)."""
    server = RelayProcess(tmp_path / "r", local_isolation="bwrap", create_timeout_s=10)
    limited = server.add_token("limited", command=True, limits={"max_concurrent": 1})
    server.start()
    try:
        nap = {"command": ["sleep", "1"], "timeout_s": 30}
        assert server.post(limited, nap).json()["state"] == "succeeded"  # how long it takes
        running = server.post(limited, {**nap, "wait": False})
        assert running.status_code == 202
        refused = server.post(limited, nap)
        assert refused.status_code == 429
        retry_after = int(refused.headers["Retry-After"])
        assert 1 <= retry_after <= 3, retry_after
        assert rate_limit(refused.headers)["concurrent"] == {"r": "0", "t": str(retry_after)}
        time.sleep(retry_after + 0.5)
        assert server.post(limited, {"command": ["true"]}).status_code == 200
    finally:
        server.stop()


async def test_timeout_is_capped_by_token_job_and_relay(rig: Rig) -> None:
    async def timeout_of(principal: Principal, request: RunRequest) -> float:
        run, _ = await rig.service.submit(principal, request, None)
        await rig.service.wait(run.id, 30)  # one at a time: the rig caps runs in flight at 3
        return float(run.timeout_s)

    capped = token("capped", max_timeout_s=2)
    assert await timeout_of(capped, RunRequest(command=["true"], timeout_s=2)) == 2
    assert await timeout_of(capped, RunRequest(command=["true"], timeout_s=2.5)) == 2
    assert await timeout_of(capped, RunRequest(command=["true"], timeout_s=1)) == 1
    echo = RunRequest(job="echo", params={"message": "x"})
    assert await timeout_of(token("jobs"), echo) == 10  # the echo job's own timeout_s
    relay_cap = rig.service.settings.max_timeout_s
    raw = RunRequest(command=["true"], timeout_s=relay_cap + 1)
    assert await timeout_of(token("raw"), raw) == relay_cap
