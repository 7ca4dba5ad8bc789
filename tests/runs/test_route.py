"""Routes (relay/runs/route.py): a run goes to the next provider of its route while its
command has not started, never runs twice unless its job is ``retry = "safe"``, and every
attempt is on the record.

The first provider is the real E2B SDK against its protocol fake (its rig's fault
switches); the second the shipped memory provider, whose world keeps a ledger of every
command started. Real SQLite, the real run service.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relay.auth import Principal
from relay.errors import Forbidden, NoRoute
from relay.http.metrics import Metrics
from relay.http.operator import breaker_health
from relay.providers.contract import TAG_ATTEMPT, TAG_RUN, Provider
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.run_state import RunState
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest, Size
from relay.runs.service import RunService
from relay.runs.view import run_model
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.rigs import RIGS
from testing.rigs.rig import Rig
from tests.conftest import make_settings

PRINCIPAL = Principal(name="router", command=True)
JOB = """
command = ["sh", "-c", "{script}"]
providers = {providers}
timeout_s = 10
allow = ["files", "timeout_s"]
{extra}
"""
COOLDOWN_S = 0.5


@dataclass
class Routed:
    """A run service over an E2B fake and a memory world, and what it published."""

    rig: Rig
    world: MemoryWorld
    service: RunService
    said: list[str]

    @property
    def e2b_creates(self) -> int:
        return int(self.rig.fake.ledger.create_attempts)  # type: ignore[attr-defined]

    @property
    def e2b_commands(self) -> int:
        return len(self.rig.fake.ledger.commands)  # type: ignore[attr-defined]

    async def run(self, **asked: Any) -> RunRecord:
        request = RunRequest(job="routed", **asked)
        submitted, _ = await self.service.submit(PRINCIPAL, request, None)
        return await self.service.wait(submitted.id, 30)


@contextlib.asynccontextmanager
async def routed(
    tmp_path: Path,
    *,
    order: tuple[str, ...] = ("e2b", "memory"),
    script: str = "echo ran",
    extra: str = "",
    variant: str | None = None,
    rig_name: str = "e2b",
    **values: Any,
) -> AsyncIterator[Routed]:
    jobs = tmp_path / "jobs" / "routed"
    jobs.mkdir(parents=True)
    names = json.dumps(list(order))
    (jobs / "job.toml").write_text(JOB.format(script=script, providers=names, extra=extra))
    with RIGS[rig_name].started(tmp_path) as rig:
        settings = make_settings(
            tmp_path,
            **{**rig.values, "providers": list(order)},
            jobs_dir=tmp_path / "jobs",
            grace_s=5,
            create_timeout_s=10,
            breaker_cooldown_s=COOLDOWN_S,
            **values,
        )
        world = MemoryWorld()
        faked = rig.client(settings) if variant is None else rig.provider(variant)
        providers: dict[str, Provider] = {
            rig_name: faked,
            "memory": MemoryProvider(settings, world),
        }
        store = await Store.open(settings.database_url)
        service = RunService(settings, store, Catalog.load(settings.jobs_dir), providers)
        said: list[str] = []
        service.events.subscribe(
            lambda event: said.append(event.message) if event.kind == "attempt" else None
        )
        try:
            yield Routed(rig, world, service, said)
        finally:
            await service.shutdown()
            await _eventually(
                lambda: not rig.alive() and not world.alive(), "a sandbox was left alive"
            )
            for provider in providers.values():
                await provider.aclose()
            await store.close()


async def _eventually(check: Callable[[], bool], what: str, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _attempts(run: RunRecord) -> list[tuple[str, str | None]]:
    """(provider, error code) of each attempt, as the API shows them."""
    return [
        (attempt.provider, attempt.error.code if attempt.error else None)
        for attempt in run_model(run).attempts
    ]


FAULTS: dict[str, tuple[dict[str, Any], str | None, str, str]] = {
    "5xx": ({"create_status": 500}, None, "provider_unavailable", "unavailable while creating"),
    "5xx after allocating": (
        {"create_allocates_then_fails": True},
        None,
        "provider_unavailable",
        "unavailable while creating",
    ),
    "hang": ({"create_hang": True}, "impatient", "provider_timeout", "create timed out after 1"),
    "refused key": ({}, "bad_key", "provider_auth", "refused the relay's credentials"),
    "quota": ({"create_status": 429}, None, "provider_rate_limited", "rate limited"),
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_create_that_fails_moves_the_run_to_the_next_provider(
    tmp_path: Path, fault: str
) -> None:
    switches, variant, code, words = FAULTS[fault]
    async with routed(tmp_path, variant=variant) as routing:
        for name, value in switches.items():
            setattr(routing.rig.faults, name, value)
        run = await routing.run()
        assert run.state is RunState.succeeded, run.error_message
        assert run.stdout == "ran\n" and run.provider == "memory"
        assert run.sandbox_id in routing.world.boxes
        assert _attempts(run) == [("e2b", code), ("memory", None)]
        first = run_model(run).attempts[0]
        assert first.sandbox_id is None and first.create_ms is not None and first.ended_at
        assert routing.e2b_creates >= (variant != "bad_key") and routing.e2b_commands == 0
        assert len(routing.world.started) == 1  # the command ran once, on memory
        assert routing.world.boxes[run.sandbox_id].tags[TAG_ATTEMPT] == "2"
        (message,) = routing.said
        assert message.startswith(f"e2b: {words}") and message.endswith("; trying memory")
        # The first provider's sandbox, where its create allocated one, is terminated.
        await _eventually(lambda: not routing.rig.alive(), "the failed create's sandbox lives on")
        assert run.cost_usd >= 0 and run.sandbox_s > 0


@pytest.mark.parametrize("name", ["exedev", "cloudflare"])
async def test_exedev_and_cloudflare_fail_over_to_the_next_provider_like_the_others(
    tmp_path: Path, name: str
) -> None:
    async with routed(tmp_path, order=(name, "memory"), rig_name=name) as routing:
        routing.rig.faults.create_status = 500
        run = await routing.run()
        assert run.state is RunState.succeeded, run.error_message
        assert run.stdout == "ran\n" and run.provider == "memory"
        assert _attempts(run) == [(name, "provider_unavailable"), ("memory", None)]
        assert len(routing.world.started) == 1
        (message,) = routing.said
        assert message.startswith(f"{name}: ") and message.endswith("; trying memory")


@pytest.mark.parametrize("name", ["exedev", "cloudflare"])
async def test_exedev_and_cloudflare_take_over_a_run_tagged_with_its_attempt(
    tmp_path: Path, name: str
) -> None:
    async with routed(tmp_path, order=("memory", name), rig_name=name) as routing:
        routing.world.faults.create_status = 503
        run = await routing.run()
        assert run.state is RunState.succeeded, run.error_message
        assert run.stdout == "ran\n" and run.provider == name
        assert _attempts(run) == [("memory", "provider_unavailable"), (name, None)]
        assert run.sandbox_id is not None
        tags = routing.rig.tags_of(run.sandbox_id)
        assert tags[TAG_RUN] == run.id and tags[TAG_ATTEMPT] == "2"


async def test_a_routed_run_reserves_at_its_dearest_provider_and_costs_what_each_attempt_billed(
    tmp_path: Path,
) -> None:
    rates = {"e2b": {"vcpu_s": 1.0, "gib_s": 0.0}, "memory": {"vcpu_s": 0.001, "gib_s": 0.0}}
    async with routed(tmp_path, cost_rates=rates) as routing:
        routing.rig.faults.create_status = 500
        run = await routing.run()
    assert _attempts(run) == [("e2b", "provider_unavailable"), ("memory", None)]
    assert run.reserved_usd == 10.0  # the job's 10 s at E2B's rate: the dearest of the two
    first = run_model(run).attempts[0]
    assert first.create_ms is not None
    e2b_cost = first.create_ms / 1000 * 1.0
    # E2B's failed create at its rate, then memory's sandbox at memory's: a sum of both.
    assert e2b_cost <= run.cost_usd < e2b_cost + 0.01 + run.sandbox_s * 0.001
    assert run.sandbox_s >= first.create_ms / 1000


async def test_a_route_that_runs_out_of_providers_ends_the_run_with_every_attempt(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path) as routing:
        routing.rig.faults.create_status = 500
        routing.world.faults.create_status = 503
        run = await routing.run()
    assert run.state is RunState.error and run.error_code == "provider_unavailable"
    assert run.error_message is not None and "e2b:" in run.error_message
    assert "memory:" in run.error_message
    assert _attempts(run) == [("e2b", "provider_unavailable"), ("memory", "provider_unavailable")]
    assert routing.said[-1].endswith("; no provider left to try")
    assert not routing.world.started


async def test_a_sandbox_lost_during_the_upload_moves_the_run_on(tmp_path: Path) -> None:
    async with routed(tmp_path, order=("memory", "e2b"), script="cat given.txt") as routing:
        routing.world.faults.upload_lost = True
        run = await routing.run(files={"given.txt": "uploaded again\n"})
    assert run.state is RunState.succeeded, run.error_message
    assert run.stdout == "uploaded again\n" and run.provider == "e2b"
    assert _attempts(run) == [("memory", "sandbox_lost"), ("e2b", None)]
    assert not routing.world.started and routing.e2b_commands == 1
    assert "memory: the sandbox was lost while uploading files; trying e2b" in routing.said


LOST_SCRIPT = "sleep 0.5; echo ran"


async def test_a_sandbox_lost_after_the_command_started_never_runs_it_again(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, order=("memory", "e2b"), script=LOST_SCRIPT) as routing:
        routing.world.faults.vanish_after_s = 0.1
        run = await routing.run()
    assert run.state is RunState.error and run.error_code == "sandbox_lost"
    assert run.provider == "memory"
    assert _attempts(run) == [("memory", "sandbox_lost")]
    # Started once, on memory; E2B was never asked for a sandbox.
    assert len(routing.world.started) == 1
    assert routing.e2b_creates == 0 and routing.e2b_commands == 0
    assert not routing.said


async def test_a_job_safe_to_repeat_runs_again_on_the_next_provider_within_its_deadline(
    tmp_path: Path,
) -> None:
    async with routed(
        tmp_path, order=("memory", "e2b"), script=LOST_SCRIPT, extra='retry = "safe"'
    ) as routing:
        routing.world.faults.vanish_after_s = 0.1
        run = await routing.run()
    assert run.state is RunState.succeeded, run.error_message
    assert run.provider == "e2b" and run.stdout == "ran\n"
    assert _attempts(run) == [("memory", "sandbox_lost"), ("e2b", None)]
    assert len(routing.world.started) == 1 and routing.e2b_commands == 1
    assert routing.said == ["memory: the sandbox was lost while running the command; trying e2b"]
    # The deadline is the first sandbox's: the retry took what was left of it.
    assert run.started_at is not None and run.ended_at is not None
    assert run.ended_at - run.started_at < 10


async def test_a_retry_never_outlives_the_runs_deadline(tmp_path: Path) -> None:
    """Lost mid-command, a job safe to repeat goes on to E2B, whose create hangs past what
    is left of the run's timeout: the run ends timed_out at its deadline, both attempts on
    the record, and it costs what each billed, once."""
    async with routed(
        tmp_path,
        order=("memory", "e2b"),
        script=LOST_SCRIPT,
        extra='retry = "safe"',
    ) as routing:
        routing.world.faults.vanish_after_s = 0.1
        routing.rig.faults.create_hang = True
        began = time.monotonic()
        run = await routing.run(timeout_s=1.0)
        assert time.monotonic() - began < 3
    assert run.state is RunState.timed_out, run.error_message
    assert _attempts(run) == [("memory", "sandbox_lost"), ("e2b", "canceled")]
    assert routing.e2b_commands == 0 and len(routing.world.started) == 1
    assert run.sandbox_s < 2


async def test_a_breaker_opens_after_failures_skips_its_provider_then_half_opens_and_closes(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, breaker_failures=2) as routing:
        breakers, metrics = routing.service.breakers, Metrics()
        metrics.attach(routing.service, None, routing.service.events, ["e2b", "memory"])
        routing.rig.faults.create_status = 500
        for _ in range(2):
            run = await routing.run()
            assert _attempts(run) == [("e2b", "provider_unavailable"), ("memory", None)]
        assert breakers.state("e2b") == "open"
        assert 'relay_provider_breaker_state{provider="e2b"} 2.0' in metrics.render().decode()
        assert breaker_health(breakers, "e2b").state == "open"  # as /v1/health shows it
        creates = routing.e2b_creates
        run = await routing.run()  # open: skipped without an attempt
        assert _attempts(run) == [("memory", None)] and routing.e2b_creates == creates
        await asyncio.sleep(COOLDOWN_S)
        assert breakers.state("e2b") == "half_open"
        assert 'relay_provider_breaker_state{provider="e2b"} 1.0' in metrics.render().decode()
        assert breaker_health(breakers, "e2b").state == "half_open"
        run = await routing.run()  # the one run that tries it: it still fails, open again
        assert _attempts(run)[0] == ("e2b", "provider_unavailable")
        assert routing.e2b_creates == creates + 1 and breakers.state("e2b") == "open"
        await asyncio.sleep(COOLDOWN_S)
        routing.rig.reset()
        run = await routing.run()  # it works: closed
        assert _attempts(run) == [("e2b", None)] and run.provider == "e2b"
        assert breakers.state("e2b") == "closed"
        assert breaker_health(breakers, "e2b").state == "closed"
        assert breaker_health(breakers, "e2b").opened == 2
        text = metrics.render().decode()
        assert 'relay_provider_breaker_state{provider="e2b"} 0.0' in text
        assert 'relay_route_attempts_total{code="provider_unavailable",provider="e2b"} 3.0' in text
        assert 'relay_route_failovers_total{code="provider_unavailable",provider="e2b"} 3.0' in text


async def test_a_warm_sandbox_on_any_provider_of_the_route_comes_before_a_cold_create(
    tmp_path: Path,
) -> None:
    # The job's pool is on memory, the first of its route; put E2B first in the route
    # (as a ranking may) and it is not asked for a sandbox while memory has a warm one.
    async with routed(tmp_path, order=("memory", "e2b"), extra="warm = 1") as routing:
        service = routing.service
        service.start()
        deadline = time.monotonic() + 10
        while service.pools.ready < 1:
            assert time.monotonic() < deadline, "the pool never filled"
            await asyncio.sleep(0.05)
        plan = service.planner.plan(PRINCIPAL, RunRequest(job="routed"), "run_warmfirst")
        reordered = dataclasses.replace(plan, route=tuple(reversed(plan.route)))
        door = service.runner.door_for(reordered)
        async with door.sandbox(reordered.spec) as box:
            assert box.provenance.pooled and box.provenance.provider == "memory"
        assert routing.e2b_creates == 0


async def test_a_route_filtered_to_nothing_names_each_providers_reason(tmp_path: Path) -> None:
    async with routed(tmp_path, order=("e2b", "memory")) as routing:
        planner = routing.service.planner
        e2b_only = Principal(name="e", command=True, providers=frozenset({"e2b"}))
        # E2B has one size, and the token may not use memory: nowhere to go.
        with pytest.raises(NoRoute) as refused:
            planner.plan(e2b_only, RunRequest(command=["true"], size=Size.large), "run_x")
        assert refused.value.status == 422 and refused.value.code == "no_route"
        assert "e2b: E2B sandbox sizes are fixed" in refused.value.message
        assert "memory: this token may not use provider 'memory'" in refused.value.message
        # Left out, never widened: E2B drops out of a large run's route, memory takes it.
        large = planner.plan(PRINCIPAL, RunRequest(command=["true"], size=Size.large), "run_z")
        assert [candidate.provider for candidate in large.route] == ["memory"]
        small = planner.plan(e2b_only, RunRequest(command=["true"]), "run_y")
        assert [candidate.provider for candidate in small.route] == ["e2b"]
        # A request narrows the route to one provider, where its token may use it.
        narrowed = planner.plan(PRINCIPAL, RunRequest(job="routed", provider="memory"), "run_n")
        assert [candidate.provider for candidate in narrowed.route] == ["memory"]
        with pytest.raises(Forbidden, match="may not use provider 'memory'"):
            planner.plan(e2b_only, RunRequest(job="routed", provider="memory"), "run_f")


def test_the_attempt_tag_names_the_run_and_the_attempt() -> None:
    from relay.providers.contract import SandboxSpec

    spec = SandboxSpec(run_id="run_a", cluster="c", timeout_s=1, attempt=2)
    assert spec.tags[TAG_RUN] == "run_a" and spec.tags[TAG_ATTEMPT] == "2"
    assert TAG_ATTEMPT not in SandboxSpec(run_id="run_a", cluster="c", timeout_s=1).tags
