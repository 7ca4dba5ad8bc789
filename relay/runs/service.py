"""RunService: the public side of runs, what the handlers and the CLI call.

submit → admission (scopes, job, params, provider check, idempotency, limits) → the run
row is written first (the intent) → a task owned by the service, not by the HTTP request,
runs the sandbox (relay/runs/runner.py: the steps of one run, and the final write).
Reading (get, list, wait, usage, deliveries) and cancelling go through here too, so the
handlers never reach the store or a provider.

A caller that disconnects does not stop its run; a retry with the same Idempotency-Key
finds it. Cancellation (``DELETE``, shutdown) and the deadline end the sandbox through
the provider context, which always terminates it.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from relay import logs
from relay.auth import Principal
from relay.errors import (
    ArtifactGone,
    Forbidden,
    IdempotencyConflict,
    NotFound,
    RunNotCancelable,
    ShuttingDown,
)
from relay.providers.contract import Provider
from relay.run_state import RunState, transition
from relay.runs.breakers import Breakers
from relay.runs.callback_urls import refuse_unsafe_callback
from relay.runs.capacity import Capacity, caps_of
from relay.runs.catalog import Catalog
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.limits import admission_for, rate_limit_headers, refusal
from relay.runs.models import RunRequest
from relay.runs.planning import Plan, Planner, request_hash
from relay.runs.pools import Pools
from relay.runs.ranking import Ranking
from relay.runs.route import Routing
from relay.runs.runner import Runner
from relay.runs.sources import sources_for
from relay.settings import Settings
from relay.store.artifacts import BlobInfo, StoredArtifact
from relay.store.database import Store, Usage
from relay.store.deliveries import Deliveries
from relay.store.latency import create_p50_ms
from relay.store.limits import DuplicateKey, LimitReached, day_start, month_start
from relay.store.objects import Objects
from relay.store.outcomes import Grouping, GroupOutcome, GroupOutcomes, Outcomes
from relay.store.records import DeliveryRecord, RunRecord, RunValues
from relay.store.reports import Backlog, Reports, SpendRow

__all__ = ["DeliveryRecord", "GroupOutcome", "RunRecord", "RunService", "new_run_id"]

log = logging.getLogger("relay.service")


def new_run_id() -> str:
    """Sortable by creation time, unguessable."""
    return f"run_{int(time.time() * 1000):011x}{secrets.token_hex(8)}"


class RunService:
    """Submits, runs, waits for, lists and cancels runs."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        catalog: Catalog,
        providers: Mapping[str, Provider],
        *,
        instance_id: str | None = None,
        events: EventBus | None = None,
        clock: Callable[[], float] = time.time,
        objects: Objects | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.costs = CostModel(providers, settings.cost_rates)
        self.events = events or EventBus()
        self.store = store
        self.catalog = catalog
        self.providers = dict(providers)
        self.planner = Planner(settings, catalog, self.providers)
        self.instance_id = instance_id or secrets.token_hex(8)
        self.accepting = True
        self.pools = Pools(
            settings,
            store,
            catalog,
            self.providers,
            self.costs,
            instance_id=self.instance_id,
            clock=clock,
        )
        self.sources = sources_for(self.providers, self.pools)
        self.breakers = Breakers(settings)
        """Each provider's breaker on this replica (relay/runs/breakers.py)."""
        self.capacity = Capacity(caps_of(settings, self.providers), store)
        """Each provider's cap of runs at once, counted in the store (relay/runs/capacity.py)."""
        self.ranking = Ranking(
            self.costs,
            functools.partial(create_p50_ms, store),
            settings.route_latency_refresh_s,
        )
        """How runs' routes are ordered (relay/runs/ranking.py)."""
        routing = Routing(
            self.providers,
            self.pools,
            self.breakers,
            self.capacity,
            self.events,
            settings.create_budget_s,
        )
        self.runner = Runner(
            settings, store, self.sources, self.events, self.costs, routing, objects
        )
        self._deliveries = Deliveries(store)
        self._reports = Reports(store)
        self._outcomes = Outcomes(store)
        self._drain_started: float | None = None

    async def submit(
        self,
        principal: Principal,
        request: RunRequest,
        idempotency_key: str | None,
        limit_headers: dict[str, str] | None = None,
    ) -> tuple[RunRecord, bool]:
        """Admit and start a run; returns it and whether it is new. ``limit_headers``, if
        given, receives the RateLimit fields of a new run's answer (relay/runs/limits.py);
        a refusal carries its own."""
        if not self.accepting:
            raise ShuttingDown(retry_after=5)
        # Only a retry with the same key is compared to its first request.
        digest = request_hash(request) if idempotency_key is not None else ""
        if idempotency_key is not None:
            existing = await self.store.find_by_key(principal.name, idempotency_key)
            if existing is not None:
                return _same_request(existing, digest), False
        run_id = new_run_id()
        plan = self.ranking.ranked(self.planner.plan(principal, request, run_id))
        if request.callback_url is not None:
            await refuse_unsafe_callback(request.callback_url, self.settings)
        now = self.clock()
        cpu, memory_mb = plan.spec.resources.cpu, plan.spec.resources.memory_mb
        if len(plan.route) > 1:
            route = tuple(candidate.provider for candidate in plan.route)
            # Reserved at the dearest provider of its route: whichever runs it, the token's
            # budget holds (the final cost replaces the reservation).
            reserved = max(
                [self.costs.cost(provider, cpu, memory_mb, plan.timeout_s) for provider in route]
            )
        else:  # a route of one (or a plan made by hand: its provider alone)
            route = (plan.provider,)
            reserved = self.costs.cost(plan.provider, cpu, memory_mb, plan.timeout_s)
        # Its sandbox may take every attempt's create budget to come (one: its create).
        creating_s = self.settings.create_budget_s if len(plan.route) > 1 else None
        run = RunRecord.new(
            run_id,
            token=principal.name,
            job=plan.job,
            provider=plan.provider,
            # No queue: the run's task starts creating its sandbox at once.
            state=transition(None, RunState.starting),
            idempotency_key=idempotency_key,
            request_hash=digest,
            timeout_s=plan.timeout_s,
            cpu=cpu,
            memory_mb=memory_mb,
            created_at=now,
            deadline=now + (creating_s or self.settings.create_timeout_s) + plan.timeout_s,
            reserved_usd=reserved,
            owner=self.instance_id,
            stdout_bytes=0,
            stderr_bytes=0,
            callback_url=request.callback_url,
            request=request.echo_text(),
        )
        self.runner.hold(run_id)  # before the row exists: a sweep now must not orphan it
        admission = admission_for(
            principal, self.settings, now, self.runner.settled(), route, self.capacity.caps
        )
        try:
            standing = await self.store.admit_run(run, admission)
        except DuplicateKey:
            self.runner.release(run_id)
            existing = await self.store.find_by_key(principal.name, idempotency_key or "")
            if existing is None:  # pragma: no cover - the unique index makes this impossible
                raise
            return _same_request(existing, digest), False
        except LimitReached as limit:
            self.runner.release(run_id)
            raise refusal(limit, admission, run.reserved_usd) from None
        except BaseException:
            self.runner.release(run_id)
            raise
        if standing is not None and standing.provider not in (None, plan.provider):
            plan, run = self._placed(plan, run, standing.provider or plan.provider)
        if limit_headers is not None and standing is not None:
            limit_headers.update(
                rate_limit_headers(admission, standing, run.reserved_usd, admitted=True)
            )
        # The run's task copies this context: its log lines carry these ids too.
        logs.bind(run_id=run_id, token=principal.name, job=plan.job, provider=plan.provider)
        self.runner.start(plan, run)
        log.info("run submitted")  # its run_id, token, job and provider: the ids just bound
        return run, True

    def _placed(self, plan: Plan, run: RunRecord, provider: str) -> tuple[Plan, RunRecord]:
        """The plan and run placed on ``provider`` by the per-provider caps: the providers
        of the route before it were full (skipped, not attempts)."""
        index = next(i for i, c in enumerate(plan.route) if c.provider == provider)
        full = tuple((c.provider, self.capacity.refusal(c.provider)) for c in plan.route[:index])
        placed = dataclasses.replace(
            plan,
            route=plan.route[index:],
            provider=provider,
            spec=plan.route[index].spec,
            skipped=full,
        )
        return placed, run.changed(provider=provider)

    # -- reading, waiting, cancelling --------------------------------------------------

    def holds(self, run_id: str) -> bool:
        """Whether this process answers for the run (admitted here, final state not yet
        stored): the reaper must leave it alone, and its live events are here."""
        return self.runner.holds(run_id)

    async def find(self, run_id: str) -> RunRecord | None:
        """The run as this process knows it best (a final state the store has not taken
        yet included), whoever's it is; None when there is no such run."""
        run = self.runner.unwritten(run_id)  # finished here, the store not yet told
        return run if run is not None else await self.store.get_run(run_id)

    async def artifact(
        self, principal: Principal, run_id: str, name: str
    ) -> tuple[StoredArtifact, BlobInfo]:
        """One kept artifact of ``principal``'s run and what is stored of it (a download's
        first step, with the run's own auth: another token's run is absent)."""
        await self.get(principal, run_id)
        artifacts = self.runner.artifacts
        found = await artifacts.find(run_id, name)
        info = None if found is None or found.sha256 is None else await artifacts.blob(found.sha256)
        if found is None or info is None:
            raise NotFound("no such artifact of this run")
        if not await artifacts.present(info):
            raise ArtifactGone()
        return found, info

    def artifact_chunks(self, info: BlobInfo) -> AsyncIterator[bytes]:
        """A stored artifact's bytes, a chunk at a time (see relay/store/artifacts.py)."""
        return self.artifact_chunks_of(info.sha256)

    def artifact_chunks_of(self, sha256: str) -> AsyncIterator[bytes]:
        """The bytes stored under ``sha256`` (of a run the caller already may read)."""
        return self.runner.artifacts.chunks(sha256)

    async def get(self, principal: Principal, run_id: str) -> RunRecord:
        """``principal``'s run, with its output so far while it runs here."""
        run = await self.find(run_id)
        if run is None or not principal.may_read_run(run.token):
            raise NotFound("no such run")  # another token's run is as good as absent
        sink = self.runner.output(run_id)
        if sink is not None and not run.state.final:
            # Running here: the output so far (kept within the same caps as the final).
            run = run.changed(
                stdout=sink.text("stdout"),
                stderr=sink.text("stderr"),
                stdout_truncated=sink.truncated("stdout"),
                stderr_truncated=sink.truncated("stderr"),
            )
        return run

    async def list(
        self,
        principal: Principal,
        *,
        state: str | Sequence[str] | None,
        job: str | None,
        limit: int,
        cursor: str | None,
        token: str | None = None,
        provider: str | None = None,
        since: float | None = None,
        until: float | None = None,
        search: str | None = None,
    ) -> tuple[builtins.list[RunRecord], str | None]:
        """A page of ``principal``'s runs (an admin's: every token's, or ``token``'s),
        newest first, without their output, and the cursor of the next page; ``state``
        one state or any of several, ``search`` a run id or text in the job or token."""
        if not principal.admin:
            if token is not None and token != principal.name:
                raise Forbidden("only an admin token lists another token's runs")
            token = principal.name
        return await self.store.list_runs(
            token,
            state=state,
            job=job,
            limit=limit,
            cursor=cursor,
            provider=provider,
            since=since,
            until=until,
            search=search,
        )

    async def deliveries(
        self, runs: Sequence[RunRecord]
    ) -> dict[str, builtins.list[DeliveryRecord]]:
        """The webhook deliveries of those ``runs`` that have a callback (one query for a
        page), by run id."""
        ids = [run.id for run in runs if run.callback_url]
        return await self._deliveries.for_runs(ids) if ids else {}

    async def wait(self, run_id: str, timeout_s: float) -> RunRecord:
        """The run once final, or as it is when ``timeout_s`` has passed."""
        end = time.monotonic() + timeout_s
        finished = await self.runner.finished(run_id, timeout_s)
        if finished is not None:
            return finished
        while True:
            run = await self.find(run_id)
            if run is None:
                raise NotFound("no such run")
            if run.state.final or time.monotonic() >= end or self.runner.stopped:
                return run
            await asyncio.sleep(min(0.25, max(0.0, end - time.monotonic())))

    async def cancel(self, principal: Principal, run_id: str) -> RunRecord:
        run = await self.get(principal, run_id)
        if run.state.final:
            raise RunNotCancelable(details={"run_id": run_id})
        if run.token != principal.name:  # an admin token: say who ended another token's run
            log.info(
                "run canceled by an admin token", extra={"run_id": run_id, "token": principal.name}
            )
        await self.store.update_run(run_id, cancel_requested=True)
        if self.runner.running(run_id):
            self.runner.stop(run_id, "canceled")
            await self.runner.closed({run_id})
        else:
            # Held by no task here (another replica, or a relay that died): end the sandbox
            # through the provider, then close the run.
            provider = self.providers.get(run.provider)
            if run.sandbox_id and provider is not None:
                await provider.terminate(run.sandbox_id)
            ended: RunValues = {
                "state": transition(run, RunState.canceled),
                "ended_at": time.time(),
            }
            if await self.store.update_run(run_id, **ended):
                run = run.changed(**ended)
                self.events.publish(RunEvent(run_id, "finished", state=run.state, run=run))
        return await self.get(principal, run_id)

    async def usage(self, principal: Principal) -> tuple[Usage, Usage]:
        """The token's usage today and this month (UTC), with the warm pools' idle time
        and cost: of the pooled sandboxes its runs claimed, or the whole relay's for an
        admin token. Not in the token's USD limits: the operator chose the pool."""
        now = self.clock()
        windows = []
        claimed_by = None if principal.admin else principal.name
        for since in (day_start(now), month_start(now)):
            usage = await self.store.usage(principal.name, since)
            seconds, usd = await self.pools.rows.idle_since(since, claimed_by)
            windows.append(dataclasses.replace(usage, pool_idle_s=seconds, pool_idle_usd=usd))
        return windows[0], windows[1]

    async def usage_today(self, token: str) -> Usage:
        """A token's usage today (UTC), whoever asks: the admin's spend page reads every
        token's standing against its limits."""
        return await self.store.usage(token, day_start(self.clock()))

    async def spend(self, principal: Principal, since: float) -> builtins.list[SpendRow]:
        """Runs and USD per day, token, provider since ``since``: every token's for an
        admin, else ``principal``'s own."""
        return await self._reports.spend(since, None if principal.admin else principal.name)

    async def provider_outcomes(self, since: float) -> dict[str, tuple[int, int, int]]:
        """Per provider, runs since ``since``, how many ended in error or lost, and how
        many in any failure (those, failed and timed_out)."""
        return await self._reports.provider_outcomes(since)

    async def outcomes(self, by: Grouping, since: float, until: float) -> GroupOutcomes:
        """How every token's runs created from ``since`` to ``until`` ended, per job or
        per provider (the admin's jobs page)."""
        return await self._outcomes.report(by, since, until)

    async def webhook_backlog(self) -> Backlog:
        return await self._reports.webhook_backlog()

    @property
    def active_runs(self) -> int:
        return len(self.runner.tasks())

    @property
    def refused_final_writes(self) -> int:
        """Runs whose final write the store refuses now (relay/runs/final_writes.py)."""
        return self.runner.finals.refused

    # -- starting and shutdown -----------------------------------------------------------

    def start(self) -> None:
        """Start the background work the service owns (the warm pools' refill)."""
        self.pools.start()

    async def replay_spool(self) -> builtins.list[str]:
        """Write into the store the outcomes a relay that stopped with the store down
        spooled (relay/runs/spool.py), before any reaper may mark those runs lost; then
        keep the spool's room reserved. The run ids taken up."""
        adopted = await self.runner.replay()
        await asyncio.to_thread(self.runner.prepare_spool)
        return adopted

    def begin_drain(self) -> None:
        """Stop accepting runs (SIGTERM); running ones get ``RELAY_DRAIN_S`` to finish."""
        if self._drain_started is None:
            self._drain_started = time.monotonic()
        self.accepting = False
        self.pools.refilling = False  # runs drain; new pooled sandboxes would only idle

    async def shutdown(self) -> None:
        """Let runs finish within the drain time, then cancel the rest and record it."""
        self.begin_drain()
        assert self._drain_started is not None
        await self.runner.shutdown(self.settings.drain_s - (time.monotonic() - self._drain_started))
        await self.pools.drain()
        await self.ranking.aclose()


def _same_request(existing: RunRecord, digest: str) -> RunRecord:
    if existing.request_hash != digest:
        raise IdempotencyConflict(details={"run_id": existing.id})
    return existing
