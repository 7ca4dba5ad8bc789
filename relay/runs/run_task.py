"""The steps of one run: open its sandbox, record it running, run the job, measure it.

open the sandbox through the run's door (leaving it always terminates the sandbox) → record
it running (a moment later, see :data:`RUNNING_WRITE_DELAY_S`) → upload the files and run
the command within what is left of the timeout → keep the files its job declares
(relay/runs/artifacts.py, bounded by its own budget) → what it cost, and every attempt. The
door is a sandbox source (relay/runs/sources.py, relay/runs/route.py): a provider, a provider
behind its warm pools, or a route over several; the task never knows which: the sandbox's
provenance says where it came from and which attempts failed before it (a route's error
that ran out of providers carries them in ``details["attempts"]``). Writing the final
state, and keeping the runs in flight, is the :class:`~relay.runs.runner.Runner`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from relay.cancellation import Alarms, Deadline, shielded
from relay.errors import RelayError
from relay.providers.contract import Attempt, OutputSink, Provenance, Sandbox, SandboxSource
from relay.run_state import RunState, transition
from relay.runs import artifacts
from relay.runs.attempts import attempts_json
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.planning import Plan
from relay.runs.route import Route
from relay.settings import Settings
from relay.store.artifacts import Artifacts
from relay.store.records import RunRecord, RunValues

log = logging.getLogger("relay.service")

CANCEL_GRACE_S = 5.0
"""How long a canceled run's files are still collected for (its sandbox still answering)."""
RUNNING_WRITE_DELAY_S = 0.05
"""A run's `running` state is stored this long after its sandbox exists: a run that ends
sooner (a quick job) is written once, final, with its sandbox id. Events (metrics, live
streams) see `running` at once; a GET may read `starting` for this long."""


class RunTask:
    """One run's steps; :attr:`run` is the run as this task has written it so far."""

    def __init__(
        self,
        plan: Plan,
        run: RunRecord,
        *,
        settings: Settings,
        door: SandboxSource,
        events: EventBus,
        costs: CostModel,
        record_running: Callable[[str, RunValues], None],
        alarms: Alarms | None = None,
        artifact_store: Artifacts | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.plan = plan
        self.run = run
        self.loop = loop
        """The loop the steps run in, when the caller holds it (the runner, which made the
        task on it): its bounds are set there without asking for it again."""
        self.settings = settings
        self.door = door
        """Where the run's sandbox comes from, whatever kind of source it is."""
        self.events = events
        self.costs = costs
        self.record_running = record_running
        """Stores the `running` state (the runner, which keeps track of the write)."""
        self.alarms = alarms if alarms is not None else Alarms()
        """Where the deferred `running` write is set (the runner's, shared by its runs)."""
        self.artifact_store = artifact_store
        """Where the run's artifacts are kept (None: they are not collected)."""
        self.sink = OutputSink(
            settings.max_output_bytes,
            lambda stream, data: events.publish(
                RunEvent(run.id, "output", stream=stream, data=data)
            ),
        )
        self.watch = _Stopwatch()
        self.provenance: Provenance | None = None
        """Where the sandbox that ran the command came from, once there is one."""
        self.outcome: RunValues = {}
        """The state the job ended in, once its command has ended (before the terminate)."""
        self.failed: tuple[Attempt, ...] = ()
        """The attempts that did not run the command (a route's; a create that failed)."""
        self.exhausted = False
        """Every attempt failed: the run's cost is theirs alone."""
        self.collected: RunValues = {}
        """The artifacts' listing once kept, or cut short by a cancel (what a canceled run's
        final write carries)."""

    async def steps(self) -> RunValues:
        """Run the job in a sandbox, always terminated; the state it ended in. A failure
        becomes an ``error`` state; a cancellation is raised."""
        final: RunValues = {}
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        try:
            self.events.publish(RunEvent(self.run.id, "state", state=RunState.starting))
            # Billed from here unless a sandbox says otherwise (its create failed, say).
            self.watch.sandbox_started = time.monotonic()
            # A create is bounded by the provider's create_timeout_s (SandboxProvider.created).
            async with self.door.sandbox(self.plan.spec) as sandbox:  # leaving it terminates
                self._sandbox_created(sandbox.provenance)
                self._mark_running(sandbox)
                try:
                    assert self.run.started_at is not None
                    final = self.outcome = await self._run_and_keep(sandbox, self.run.started_at)
                finally:
                    self.alarms.clear(self)  # the deferred `running` write, if not done yet
                    self._ran_on(sandbox)
                terminate_started = time.monotonic()
            self.watch.timings["terminate_ms"] = _ms_since(terminate_started)
        except asyncio.CancelledError:
            self._canceled_on_the_way()
            raise
        except Exception as exc:
            final = failure(self.run, self.plan, final, exc)
            self._failed_by(exc, final)
        return final

    def _ran_on(self, sandbox: Sandbox) -> None:
        """The sandbox that ran the command (a route may have moved the run since it was
        created): the run's provider and sandbox id, and the attempts before it."""
        provenance = sandbox.provenance
        self.provenance, self.failed = provenance, provenance.attempts
        self.watch.sandbox_started = provenance.billed_from
        # Its last sandbox failed too (the run's deadline came during a route's next
        # attempt): every attempt is on the record, and the cost is theirs.
        self.exhausted = any(tried.sandbox_id == sandbox.id for tried in provenance.attempts)
        if sandbox.id != self.run.sandbox_id or provenance.provider != self.run.provider:
            self.run = self.run.changed(sandbox_id=sandbox.id, provider=provenance.provider)

    def _canceled_on_the_way(self) -> None:
        """Canceled while a route was still getting a sandbox: the attempts it made (each
        billed for as long as it took) are the run's record and its whole cost."""
        if self.provenance is None and isinstance(self.door, Route) and self.door.attempts:
            self.failed, self.exhausted = self.door.attempts, True

    def _failed_by(self, exc: Exception, final: RunValues) -> None:
        """The attempts of a run that ended by ``exc``: a route's that ran out (in its
        details), else one for a create that failed on the run's only provider."""
        tried = exc.details.get("attempts") if isinstance(exc, RelayError) else None
        if tried:
            self.failed, self.exhausted = tuple(tried), True
        elif self.provenance is None and self.watch.sandbox_started is not None:
            began = self.watch.sandbox_started
            self.failed = (
                Attempt(
                    provider=self.plan.provider,
                    sandbox_id=None,
                    error_code=str(final.get("error_code") or "internal"),
                    error_message=str(final.get("error_message") or ""),
                    create_ms=_ms_since(began),
                    ended_at=time.time(),
                    billed_s=round(time.monotonic() - began, 3),
                ),
            )
            self.exhausted = True

    async def _run_and_keep(self, sandbox: Sandbox, started_at: float) -> RunValues:
        """Run the job, then keep the files it declares before the sandbox ends; a canceled
        run keeps what it wrote so far too, within :data:`CANCEL_GRACE_S` (its listing in
        :attr:`collected`, for the runner's canceled write)."""
        try:
            final = await self._exec(sandbox, started_at)
        except asyncio.CancelledError:
            canceled_now: RunValues = {"state": RunState.canceled}
            await shielded(self._collect(sandbox, canceled_now, CANCEL_GRACE_S))
            raise
        # The job's outcome stands against a cancel from here (a DELETE or a shutdown
        # during its terminate), unless it requires its files whole: its success is not one
        # until they are kept, and a cancel while they are collected leaves it canceled.
        if not (self.plan.artifacts_required and final.get("state") == RunState.succeeded):
            self.outcome = final
        return await self._collect(sandbox, final)

    async def _collect(
        self, sandbox: Sandbox, final: RunValues, within_s: float | None = None
    ) -> RunValues:
        """Keep the files the job declares (relay/runs/artifacts.py), in ``within_s`` at
        most (else its own budget), never past the sandbox's lifetime."""
        if not self.plan.artifacts:
            return final
        started, watch = time.monotonic(), self.watch
        assert watch.sandbox_started is not None
        lifetime_left = self.plan.spec.lifetime_s - (started - watch.sandbox_started)
        if within_s is not None:
            lifetime_left = min(lifetime_left, within_s + artifacts.TERMINATE_MARGIN_S)
        try:
            # The listing lands in `collected` once recorded, also when a cancel (a DELETE,
            # the shutdown) cuts the collection short: the run lists what it kept.
            return await artifacts.collected(
                sandbox,
                final,
                plan=self.plan,
                run=self.run,
                store=self.artifact_store,
                settings=self.settings,
                lifetime_left_s=lifetime_left,
                listed=self.collected,
            )
        finally:
            watch.timings["artifacts_ms"] = _ms_since(started)

    def _sandbox_created(self, provenance: Provenance) -> None:
        """The sandbox exists: billed from when its provenance says (its create call, or
        a warm pool's claim: its idle time before was the pool's cost)."""
        self.provenance, watch = provenance, self.watch
        watch.sandbox_started = provenance.billed_from
        watch.timings["create_ms"] = _ms_since(watch.started)
        watch.timings["pooled"] = provenance.pooled

    def _mark_running(self, sandbox: Sandbox) -> None:
        """The sandbox exists: the run is running, and its deadline starts now. Its
        `running` write is an alarm set under this task, cleared when the run has ended."""
        run, started_at = self.run, time.time()
        running: RunValues = {
            "state": transition(run, RunState.running),
            "sandbox_id": sandbox.id,
            "started_at": started_at,
            "deadline": started_at + self.plan.timeout_s,
        }
        provenance = sandbox.provenance
        if provenance.provider != run.provider:  # a route's later provider took it
            running["provider"] = provenance.provider
        if provenance.attempts:
            running["attempts"] = attempts_json(provenance.attempts)
        self.events.publish(RunEvent(run.id, "state", state=RunState.running))
        # Stored a moment later, unless the run has ended by then: its final write then
        # carries the sandbox id, one transaction instead of two.
        assert self.loop is not None  # set by steps
        self.alarms.set_on(
            self.loop, self, RUNNING_WRITE_DELAY_S, self.record_running, run.id, running
        )
        self.run = run.changed(**running)

    async def _exec(self, sandbox: Sandbox, started_at: float) -> RunValues:
        """Upload the job's files and run its command for what is left of its timeout;
        the state it ended in (``timed_out`` when the deadline passed)."""
        plan, watch = self.plan, self.watch
        # One deadline for the upload and the command: a provider that stops answering
        # an upload must not hold the run (and its sandbox) past the job's timeout.
        # A Deadline, not asyncio.timeout: no coroutines to enter and leave, and an SDK
        # that swallows the cancellation is cancelled again.
        deadline = Deadline(max(0.0, plan.timeout_s - (time.time() - started_at)), self.loop)
        result = None
        try:
            with deadline:
                if plan.files:
                    await sandbox.upload(plan.files)
                watch.exec_started = time.monotonic()
                remaining = max(0.0, plan.timeout_s - (time.time() - started_at))
                result = await sandbox.exec(
                    plan.argv,
                    stdin=plan.stdin,
                    env=plan.env,
                    workdir=plan.workdir,
                    timeout_s=remaining,
                    output=self.sink,
                )
        except TimeoutError:
            if not deadline.expired():
                raise
        if watch.exec_started is not None:
            watch.timings["exec_ms"] = _ms_since(watch.exec_started)
        if result is None:
            return {"state": transition(self.run, RunState.timed_out)}
        if result.memory_limit_mb is not None:
            return {
                "state": transition(self.run, RunState.failed),
                "exit_code": result.exit_code,
                "error_code": "out_of_memory",
                "error_message": (
                    f"the job exceeded its memory limit ({result.memory_limit_mb} MiB) "
                    "and was killed"
                ),
            }
        state = RunState.succeeded if result.exit_code == 0 else RunState.failed
        return {"state": transition(self.run, state), "exit_code": result.exit_code}

    def measured(self, final: RunValues) -> RunValues:
        """``final`` with what the run cost (every attempt's), its attempts, and ``watch``'s
        timings completed."""
        plan, sink, watch = self.plan, self.sink, self.watch
        if watch.exec_started is not None and "exec_ms" not in watch.timings:
            watch.timings["exec_ms"] = _ms_since(watch.exec_started)
        if sink.first_output_at is not None:
            watch.timings["first_output_ms"] = int((sink.first_output_at - watch.started) * 1000)
        if watch.sandbox_started is None:
            return final
        resources = plan.spec.resources
        cpu, memory_mb, costs = resources.cpu, resources.memory_mb, self.costs
        seconds, cost = 0.0, 0.0
        for attempt in self.failed:  # what each attempt before billed, at its provider
            seconds += attempt.billed_s
            cost += costs.cost(attempt.provider, cpu, memory_mb, attempt.billed_s)
        measured: RunValues = {**final}
        if not self.exhausted:
            # Billed from the create call to the end of terminate: what the provider saw.
            held = round(time.monotonic() - watch.sandbox_started, 3)
            provider = self.provenance.provider if self.provenance else plan.provider
            seconds += held
            cost += costs.cost(provider, cpu, memory_mb, held)
        if self.failed:
            measured["attempts"] = attempts_json(self._every_attempt(final))
            if self.run.provider != plan.provider:
                measured["provider"] = self.run.provider
            cost = round(cost, 9)
        return {**measured, "sandbox_s": round(seconds, 3), "cost_usd": cost}

    def _every_attempt(self, final: RunValues) -> Sequence[Attempt]:
        """The failed attempts, and the one that ran the command (its error: the run's)."""
        if self.exhausted or self.provenance is None:
            return self.failed
        provenance, broke = self.provenance, final.get("state") == RunState.error
        ran = Attempt(
            provider=provenance.provider,
            sandbox_id=self.run.sandbox_id,
            error_code=str(final.get("error_code") or "") if broke else "",
            error_message=str(final.get("error_message") or "") if broke else "",
            create_ms=provenance.create_ms or int(self.watch.timings.get("create_ms", 0)),
            ended_at=time.time(),
            billed_s=0.0,
        )
        return (*self.failed, ran)


@dataclass
class _Stopwatch:
    """When a run's steps began (monotonic seconds), and the timings it reports."""

    started: float = field(default_factory=time.monotonic)
    sandbox_started: float | None = None  # billing starts here (Provenance.billed_from)
    exec_started: float | None = None
    timings: dict[str, int | bool] = field(default_factory=dict)


def failure(run: RunRecord, plan: Plan, final: RunValues, exc: Exception) -> RunValues:
    """The final state after ``exc`` ended the task of ``run`` (as the task wrote it)."""
    run_id = run.id
    if isinstance(exc, RelayError):
        if final:  # the job ended; only terminating failed: the reaper retries it
            log.error(
                "terminate failed",
                extra={"run_id": run_id, "provider": plan.provider, "error_code": exc.code},
            )
            return final
        return {
            "state": transition(run, RunState.error),
            "error_code": exc.code,
            "error_message": exc.message,
            "error_retry_after_s": exc.retry_after,
        }
    log.error(
        "run failed inside the relay",
        extra={"run_id": run_id, "error_class": type(exc).__name__},
    )
    return {
        "state": transition(run, RunState.error),
        "error_code": "internal",
        "error_message": "the relay failed while running this job",
    }


def canceled(run: RunRecord, reason: str) -> RunValues:
    """The final state of ``run`` canceled for ``reason`` (canceled, shutdown, elsewhere)."""
    final: RunValues = {"state": transition(run, RunState.canceled)}
    if reason == "shutdown":
        final |= {
            "error_code": "shutting_down",
            "error_message": "the relay shut down before the run ended",
        }
    return final


def _ms_since(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
