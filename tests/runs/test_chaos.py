"""Seeded random schedules of submits, cancels, faults and crashes: nothing leaks.

200 schedules on the in-memory provider world, and a few on each real SDK against its
protocol-level fake. A failure names the seeds; replay one with
``python -m testing.chaos SEED [memory|<a provider with a fake>]``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from testing.chaos import fake_backend, run_many, run_schedule
from testing.rigs import ON_FAKES
from testing.route_chaos import RouteReport, run_route_schedule
from tests.conftest import new_database

# Hundreds of schedules.
pytestmark = pytest.mark.slow

SCHEDULES = 200


def _failures(reports: list) -> str:  # type: ignore[type-arg]
    return ", ".join(f"{r.seed} (leaked {r.leaked}, open {r.not_final})" for r in reports)


async def test_no_schedule_leaks_a_sandbox_or_leaves_a_run_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL)  # injected faults log on purpose
    reports = await run_many(range(SCHEDULES), tmp_path)
    failed = [r for r in reports if not r.ok]
    assert not failed, "seeds that leaked or left runs open: " + _failures(failed)
    assert len(reports) == SCHEDULES
    # The schedules really exercised the paths they claim to.
    assert sum(r.restarts for r in reports) >= 20
    assert sum(r.ended_by_reaper for r in reports) >= 50
    assert sum(r.ended_by_run for r in reports) >= 200
    assert sum(r.vanished for r in reports) >= 10


@pytest.mark.parametrize("name", ON_FAKES)
# A simulated crash abandons the Modal client mid-call, leaving one of its internal
# coroutines unawaited: an artifact of killing a client in-process, not of the relay.
@pytest.mark.filterwarnings("ignore:coroutine 'Resolver.load' was never awaited:RuntimeWarning")
async def test_schedules_against_each_provider_fake(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL)
    with fake_backend(name, tmp_path) as backend:
        reports = [
            await run_schedule(seed, tmp_path / f"s{seed}", backend, steps=12) for seed in range(3)
        ]
    failed = [r for r in reports if not r.ok]
    assert not failed, f"{name} seeds that leaked or left runs open: " + _failures(failed)
    assert sum(r.runs for r in reports) >= 5 and sum(r.created for r in reports) >= 3


ROUTED_SCHEDULES = 60


def _route_failures(reports: list[RouteReport]) -> str:
    return ", ".join(
        f"{r.seed} (leaked {r.leaked}, open {r.not_final}, twice {r.run_twice}, "
        f"output lost {r.outputs_lost})"
        for r in reports
    )


async def test_routed_schedules_with_provider_outages_run_nothing_twice_and_lose_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs routed over two providers while either goes down (creates refused or hanging),
    its sandboxes vanish, relays crash: every run final, 0 commands run twice, 0 sandboxes
    left, 0 finished outputs lost. Replay one with ``python -m testing.route_chaos SEED``."""
    caplog.set_level(logging.CRITICAL)
    reports = []
    for start in range(0, ROUTED_SCHEDULES, 10):
        reports += await asyncio.gather(
            *(run_route_schedule(seed, tmp_path / f"r{seed}") for seed in range(start, start + 10))
        )
    failed = [r for r in reports if not r.ok]
    assert not failed, "routed seeds that broke a promise: " + _route_failures(failed)
    # The schedules really moved runs from one provider to the other, and crashed relays.
    assert sum(r.failovers for r in reports) >= 150
    assert sum(r.restarts for r in reports) >= 20
    assert sum(r.runs for r in reports) >= 500


@pytest.mark.postgres
async def test_routed_schedules_on_two_replicas_sharing_postgresql(
    tmp_path: Path, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same promises with two replicas at once on one PostgreSQL database."""
    caplog.set_level(logging.CRITICAL)
    reports = [
        await run_route_schedule(
            seed,
            tmp_path / f"p{seed}",
            database_url=await new_database(postgres_url),
            replicas=2,
        )
        for seed in range(4)
    ]
    failed = [r for r in reports if not r.ok]
    assert not failed, "replica seeds that broke a promise: " + _route_failures(failed)
    assert sum(r.failovers for r in reports) >= 2 and sum(r.runs for r in reports) >= 40
