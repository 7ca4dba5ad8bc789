"""A tenant attacks the routes: nothing a request of its own gets wrong opens a provider's
breaker for everyone (relay/runs/breakers.py: "never a request's own fault").

The first provider is the real E2B SDK against its protocol fake (a template whose name
starts with ``missing`` is answered 404, as E2B's API answers a template it does not
have); the second the memory provider. Real SQLite, the real run service.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from relay.run_state import RunState
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.view import run_model
from relay.store.records import RunRecord
from tests.runs.test_route import PRINCIPAL, Routed, routed


async def test_a_requests_own_unknown_image_never_opens_the_providers_breaker(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path, breaker_failures=2) as routing:
        service = routing.service
        for _ in range(3):
            request = RunRequest(command=["echo", "hi"], image="missing-mine", provider="auto")
            submitted, _ = await service.submit(PRINCIPAL, request, None)
            await service.wait(submitted.id, 30)
        assert routing.e2b_creates == 3  # each tried e2b: its breaker never skipped it
        assert service.breakers.state("e2b") == "closed"
        # Another tenant's run still goes to the first provider of the route.
        run = await routing.run()
        assert run.provider == "e2b", run.error_message


async def _canceled_during_failover(routing: Routed) -> RunRecord:
    """E2B's create fails; the run is canceled while memory's create is on its way."""
    routing.rig.faults.create_status = 500
    routing.world.faults.create_delay_s = 2.0
    service = routing.service
    submitted, _ = await service.submit(PRINCIPAL, RunRequest(job="routed", wait=False), None)
    for _ in range(100):
        if any("trying memory" in said for said in routing.said):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # memory's create under way
    await service.cancel(PRINCIPAL, submitted.id)
    return await service.wait(submitted.id, 30)


async def test_a_cancel_during_the_failover_runs_nothing_and_leaves_no_sandbox(
    tmp_path: Path,
) -> None:
    """The fixture's end checks that neither provider has a sandbox left."""
    async with routed(tmp_path) as routing:
        run = await _canceled_during_failover(routing)
        assert run.state is RunState.canceled, run.error_message
        assert routing.e2b_commands == 0 and not routing.world.started


async def test_a_run_canceled_during_the_failover_keeps_its_failed_attempts_on_record(
    tmp_path: Path,
) -> None:
    async with routed(tmp_path) as routing:
        run = await _canceled_during_failover(routing)
        tried = [(a.provider, a.error.code if a.error else None) for a in run_model(run).attempts]
        assert tried == [("e2b", "provider_unavailable"), ("memory", "canceled")]
        assert run.sandbox_s is not None and run.sandbox_s < 5


async def test_a_sandbox_a_failed_create_made_is_ended_though_its_terminates_fail(
    tmp_path: Path,
) -> None:
    """Memory's create makes a sandbox then answers 503, and refuses its terminate and its
    next; the run goes on on E2B, and the reaper's sweeps end memory's sandbox."""
    async with routed(tmp_path, order=("memory", "e2b")) as routing:
        routing.world.faults.create_allocates_then_fails = True
        routing.world.faults.terminate_failures = 2
        run = await routing.run()
        assert run.state is RunState.succeeded, run.error_message
        assert run.provider == "e2b" and not routing.world.started
        assert routing.world.alive(), "the terminates failed: it is still there"
        service = routing.service
        reaper = Reaper(
            service.store,
            service.providers,
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=5,
            single_replica=True,
        )
        for _ in range(3):  # each sweep tries once; the world refuses two terminates in all
            report = await reaper.sweep()
        assert not routing.world.alive(), report


async def test_a_4xx_a_provider_answers_a_runs_create_never_opens_its_breaker(
    tmp_path: Path,
) -> None:
    """Any answer in the 4xx range the adapter has no name for (here memory's 400 to every
    create) is about what was asked: each run still tries memory first, then runs on E2B."""
    async with routed(tmp_path, order=("memory", "e2b"), breaker_failures=2) as routing:
        routing.world.faults.create_status = 400
        service = routing.service
        for _ in range(3):
            run = await routing.run()
            tried = [
                (a.provider, a.error.code if a.error else None) for a in run_model(run).attempts
            ]
            assert tried[0] == ("memory", "provider_error"), tried
            assert run.provider == "e2b", run.error_message
        assert service.breakers.state("memory") == "closed"
