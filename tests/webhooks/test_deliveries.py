"""Delivery rows in a real store (SQLite file, and PostgreSQL when one can be started):
written with the final state on every path that ends a run, claimed by one replica only."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relay.auth import Principal
from relay.runs.catalog import Catalog
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import Store
from relay.store.deliveries import Deliveries
from relay.store.records import DeliveryRecord
from relay.webhooks.dispatcher import WebhookDispatcher
from testing.postgres import new_database, postgres_url
from testing.rows import run_row
from tests.conftest import REPO, make_settings
from tests.receiver import Receiver

__all__ = ["postgres_url"]  # the session fixture, found by pytest through this module


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":  # a database of the test's own: no pending deliveries
        return await new_database(request.getfixturevalue("postgres_url"))
    return f"sqlite:///{tmp_path / 'relay.db'}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    opened = await Store.open(store_url)
    yield opened
    await opened.close()


def new_id() -> str:
    return "run_" + secrets.token_hex(8)


async def running_run(store: Store, url: str | None, **values: Any) -> str:
    run_id = new_id()
    await store.admit_run(run_row(run_id, token="hooks", callback_url=url, **values))
    return run_id


async def deliveries_of(store: Store, run_id: str) -> list[DeliveryRecord]:
    return (await Deliveries(store).for_runs([run_id])).get(run_id, [])


async def test_the_final_write_creates_one_durable_delivery(store: Store, store_url: str) -> None:
    hooked = await running_run(store, "https://hooks.example.com/h")
    silent = await running_run(store, None)
    assert await deliveries_of(store, hooked) == []
    assert await store.update_run(hooked, state="succeeded", exit_code=0)
    await store.update_run(silent, state="succeeded", exit_code=0)
    # A second final write (never allowed to change the state) adds nothing either.
    assert not await store.update_run(hooked, state="failed")
    await store.update_run(hooked, only_if_active=False, state="succeeded")
    # As if the relay crashed right after the final write: a fresh process finds it.
    reopened = await Store.open(store_url)
    try:
        (delivery,) = await deliveries_of(reopened, hooked)
        assert await deliveries_of(reopened, silent) == []
    finally:
        await reopened.close()
    assert delivery.state == "pending" and delivery.attempts == 0
    assert delivery.url == "https://hooks.example.com/h" and delivery.token == "hooks"
    assert delivery.next_attempt_at <= time.time()


async def test_runs_the_reaper_marks_lost_get_a_delivery(tmp_path: Path, store: Store) -> None:
    settings = make_settings(tmp_path)
    service = RunService(settings, store, Catalog.load(REPO / "jobs"), {})
    run_id = await running_run(store, "https://hooks.example.com/h")
    reaper = Reaper(
        store,
        {},
        service.settings,
        holds=service.holds,
        instance_id=service.instance_id,
        events=service.events,
        grace_s=5,
        single_replica=True,
    )
    report = await reaper.sweep()
    assert run_id in report.lost_runs
    (delivery,) = await deliveries_of(store, run_id)
    assert delivery.state == "pending"


async def test_a_run_canceled_from_another_replica_gets_a_delivery(
    tmp_path: Path, store: Store
) -> None:
    settings = make_settings(tmp_path)
    service = RunService(settings, store, Catalog.load(REPO / "jobs"), {})
    run_id = await running_run(store, "https://hooks.example.com/h")
    canceled = await service.cancel(Principal(name="hooks"), run_id)
    assert canceled.state == "canceled"
    assert len(await deliveries_of(store, run_id)) == 1


async def test_of_many_claims_exactly_one_wins(store: Store, store_url: str) -> None:
    run_id = await running_run(store, "https://hooks.example.com/h")
    await store.update_run(run_id, state="failed", exit_code=1)
    (delivery,) = await deliveries_of(store, run_id)
    other = await Store.open(store_url)  # a second replica's connection pool
    try:
        now = time.time()
        claims = await asyncio.gather(
            *(
                Deliveries(either).claim(delivery.id, f"replica-{i}", now, 30)
                for i, either in enumerate([store, other] * 5)
            )
        )
    finally:
        await other.close()
    winners = [claim for claim in claims if claim is not None]
    assert len(winners) == 1 and winners[0].attempts == 1
    # Held: not due for anyone until the lease ends or the holder records the attempt.
    assert delivery.id not in await Deliveries(store).due(time.time(), 10)
    assert delivery.id in await Deliveries(store).due(time.time() + 31, 10)
    assert not await Deliveries(store).record(
        delivery.id, "not-the-holder", {"attempt": 1}, state="delivered", next_attempt_at=0
    )


async def test_two_replicas_never_send_the_same_delivery(tmp_path: Path, store_url: str) -> None:
    stores = [await Store.open(store_url), await Store.open(store_url)]
    settings = make_settings(
        tmp_path, webhook_allow_http=True, webhook_allow_private=True, webhook_secret="s"
    )
    try:
        with Receiver() as receiver:
            run_ids = []
            for _ in range(6):
                run_id = await running_run(stores[0], receiver.url)
                await stores[0].update_run(run_id, state="succeeded", exit_code=0)
                run_ids.append(run_id)
            replicas = [
                WebhookDispatcher(settings, one, secret_for=lambda name: None) for one in stores
            ]
            for _ in range(3):
                await asyncio.gather(*(replica.dispatch_due() for replica in replicas))
            for replica in replicas:
                await replica.drain()
                await replica.aclose()
            for run_id in run_ids:
                assert len(receiver.for_run(run_id)) == 1, run_id
                (delivery,) = await deliveries_of(stores[1], run_id)
                assert delivery.state == "delivered" and delivery.attempts == 1
    finally:
        for one in stores:
            await one.close()


async def test_a_receiver_too_slow_to_answer_is_a_timeout_retried_later(
    tmp_path: Path, store: Store
) -> None:
    settings = make_settings(
        tmp_path,
        webhook_allow_http=True,
        webhook_allow_private=True,
        webhook_secret="s",
        webhook_timeout_s=0.2,
        webhook_backoff_s=60,
    )
    with Receiver(delay_s=0.5) as receiver:
        run_id = await running_run(store, receiver.url)
        await store.update_run(run_id, state="succeeded", exit_code=0)
        dispatcher = WebhookDispatcher(settings, store, secret_for=lambda name: None)
        started = time.time()
        assert await dispatcher.dispatch_due() == 1
        await dispatcher.drain()
        ended = time.time()
        await dispatcher.aclose()
    (delivery,) = await deliveries_of(store, run_id)
    assert delivery.state == "pending" and delivery.attempts == 1
    assert '"error": "timeout"' in delivery.attempt_log
    # Backoff with jitter, 30-60 s after the attempt, which fell between these two moments
    # (after it, a busy machine may take its time to read the delivery back).
    assert started + 30 <= delivery.next_attempt_at <= ended + 60
    assert delivery.lease_owner is None


async def test_a_webhook_carries_the_runs_artifacts_as_its_json_lists_them(
    tmp_path: Path, store: Store
) -> None:
    settings = make_settings(
        tmp_path, webhook_allow_http=True, webhook_allow_private=True, webhook_secret="s"
    )
    listing = (
        '[{"name":"out/a.txt","size":2,"sha256":"' + "ab" * 32 + '","content_type":"text/plain",'
        '"truncated":false,"truncated_by":null,"skipped":null}]'
    )
    with Receiver() as receiver:
        run_id = await running_run(store, receiver.url)
        await store.update_run(run_id, state="succeeded", exit_code=0, artifacts=listing)
        dispatcher = WebhookDispatcher(settings, store, secret_for=lambda name: None)
        assert await dispatcher.dispatch_due() == 1
        await dispatcher.drain()
        await dispatcher.aclose()
        (sent,) = receiver.for_run(run_id)
    (artifact,) = json.loads(sent.body)["artifacts"]
    assert artifact["name"] == "out/a.txt" and artifact["sha256"] == "ab" * 32
    assert artifact["url"] == f"/v1/runs/{run_id}/artifacts/out/a.txt"
