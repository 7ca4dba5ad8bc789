"""RunService: the one place that owns a run's lifecycle.

submit → admission (scopes, job, params, provider check, idempotency) → the run row is
written first (the intent) → a task owned by the service, not by the HTTP request, runs
the sandbox → every state change goes to the store → the final row is written once.

A caller that disconnects does not stop its run; a retry with the same Idempotency-Key
finds it. Cancellation (``DELETE``, shutdown) and the deadline end the sandbox through
the provider context, which always terminates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relay import logs
from relay.auth import Principal
from relay.errors import (
    IdempotencyConflict,
    NotFound,
    ProviderTimeout,
    RelayError,
    RunNotCancelable,
    ShuttingDown,
)
from relay.providers.base import (
    OutputSink,
    Provider,
    Sandbox,
    shielded,
)
from relay.runs.callback_urls import refuse_unsafe_callback
from relay.runs.catalog import Catalog
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.models import RunRequest, RunState
from relay.runs.planning import Plan, Planner, request_hash
from relay.settings import Settings
from relay.store.database import Store, Usage
from relay.store.limits import (
    Admission,
    DuplicateKey,
    LimitReached,
    day_start,
    month_start,
    refusal,
)

log = logging.getLogger("relay.service")

RUNNING_WRITE_DELAY_S = 0.05
"""A run's `running` state is stored this long after its sandbox exists: a run that ends
sooner (a quick job) is written once, final, with its sandbox id. Events (metrics, live
streams) see `running` at once; a GET may read `starting` for this long."""

FINAL_WRITE_RETRY_S = (0.1, 5.0)
"""A final write the store refused is tried again after the first figure, doubling up to
the second, until it lands (the outcome waits in memory meanwhile)."""


class _Done(asyncio.Event):
    """Set when a run is final; carries the final row so a waiter needn't read it again."""

    row: dict[str, Any] | None = None


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
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._done: dict[str, _Done] = {}
        self._cancel_reason: dict[str, str] = {}
        self._writes: set[asyncio.Task[None]] = set()  # deferred `running` writes in flight
        # Runs this process answers for: from admission until their final state is stored
        # (or given up at shutdown). The reaper leaves them alone; any other active run
        # owned by this process is an orphan (its task died without a final write).
        self._held: set[str] = set()
        # Final rows the store has refused so far, kept until a retry lands.
        self._unwritten: dict[str, dict[str, Any]] = {}
        self._output: dict[str, OutputSink] = {}  # running runs' output so far, for a GET
        self._closing = asyncio.Event()  # set at shutdown: final writes stop retrying
        self._drain_started: float | None = None

    async def submit(
        self, principal: Principal, request: RunRequest, idempotency_key: str | None
    ) -> tuple[dict[str, Any], bool]:
        """Admit and start a run; returns its row and whether it is new."""
        if not self.accepting:
            raise ShuttingDown(retry_after=5)
        # Only a retry with the same key is compared to its first request.
        digest = request_hash(request) if idempotency_key is not None else ""
        if idempotency_key is not None:
            existing = await self.store.find_by_key(principal.name, idempotency_key)
            if existing is not None:
                return self._same_request(existing, digest), False
        run_id = new_run_id()
        plan = self.planner.plan(principal, request, run_id)
        if request.callback_url is not None:
            await refuse_unsafe_callback(request.callback_url, self.settings)
        now = self.clock()
        cpu, memory_mb = plan.spec.resources.cpu, plan.spec.resources.memory_mb
        row = {
            "id": run_id,
            "token": principal.name,
            "job": plan.job,
            "provider": plan.provider,
            # No queue: the run's task starts creating its sandbox at once.
            "state": RunState.starting.value,
            "idempotency_key": idempotency_key,
            "request_hash": digest,
            "timeout_s": plan.timeout_s,
            "cpu": cpu,
            "memory_mb": memory_mb,
            "created_at": now,
            "deadline": now + self.settings.create_timeout_s + plan.timeout_s,
            "reserved_usd": self.costs.cost(plan.provider, cpu, memory_mb, plan.timeout_s),
            "owner": self.instance_id,
            "stdout": "",
            "stderr": "",
            "timings": "{}",
            "callback_url": request.callback_url,
        }
        admission = Admission(
            token_concurrent=principal.max_concurrent,
            global_concurrent=self.settings.max_concurrent,
            runs_per_day=principal.runs_per_day,
            usd_per_day=principal.usd_per_day,
            now=now,
        )
        self._held.add(run_id)  # before the row exists: a sweep now must not call it orphaned
        try:
            await self.store.admit_run(row, admission)
        except DuplicateKey:
            self._held.discard(run_id)
            existing = await self.store.find_by_key(principal.name, idempotency_key or "")
            if existing is None:  # pragma: no cover - the unique index makes this impossible
                raise
            return self._same_request(existing, digest), False
        except LimitReached as limit:
            self._held.discard(run_id)
            raise refusal(limit) from None
        except BaseException:
            self._held.discard(run_id)
            raise
        self._done[run_id] = _Done()
        # The run's task copies this context: its log lines carry these ids too.
        logs.bind(run_id=run_id, token=principal.name, job=plan.job, provider=plan.provider)
        self._tasks[run_id] = asyncio.create_task(self._execute(plan, dict(row)), name=run_id)
        log.info(
            "run submitted",
            extra={
                "run_id": run_id,
                "token": principal.name,
                "job": plan.job,
                "provider": plan.provider,
            },
        )
        return row, True

    @staticmethod
    def _same_request(existing: dict[str, Any], digest: str) -> dict[str, Any]:
        if existing["request_hash"] != digest:
            raise IdempotencyConflict(details={"run_id": existing["id"]})
        return existing

    # -- the run -----------------------------------------------------------------------

    async def _execute(self, plan: Plan, row: dict[str, Any]) -> None:
        """Run the plan; ``row`` is the run as admitted, kept up to date with what is written."""
        run_id = row["id"]
        sink = OutputSink(
            self.settings.max_output_bytes,
            lambda stream, data: self.events.publish(
                RunEvent(run_id, "output", stream=stream, data=data)
            ),
        )
        self._output[run_id] = sink
        watch = _Stopwatch()
        final: dict[str, Any] = {}
        try:
            self.events.publish(RunEvent(run_id, "state", state=RunState.starting.value))
            async with contextlib.AsyncExitStack() as stack:
                sandbox = await self._open_sandbox(stack, plan, watch)
                self._mark_running(stack, row, sandbox.id, plan)
                final = await self._exec(sandbox, plan, row["started_at"], sink, watch)
                terminate_started = time.monotonic()
            watch.timings["terminate_ms"] = _ms_since(terminate_started)
        except asyncio.CancelledError:
            final = _canceled(self._cancel_reason.get(run_id, "shutdown"))
            raise
        except Exception as exc:
            final = _failure(run_id, plan, final, exc)
        finally:
            final = self._measured(plan, final, sink, watch)
            await shielded(self._finish(row, final, sink, watch.timings))

    async def _open_sandbox(
        self, stack: contextlib.AsyncExitStack, plan: Plan, watch: _Stopwatch
    ) -> Sandbox:
        """Create the sandbox inside ``stack`` (leaving it terminates the sandbox)."""
        provider = self.providers[plan.provider]
        watch.sandbox_started = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.create_timeout_s + 5):
                sandbox = await stack.enter_async_context(provider.sandbox(plan.spec))
        except TimeoutError as exc:
            raise ProviderTimeout("the provider did not create the sandbox in time") from exc
        watch.timings["create_ms"] = _ms_since(watch.started)
        return sandbox

    def _mark_running(
        self, stack: contextlib.AsyncExitStack, row: dict[str, Any], sandbox_id: str, plan: Plan
    ) -> None:
        """The sandbox exists: the run is running, and its deadline starts now."""
        started_at = time.time()
        running = {
            "state": RunState.running.value,
            "sandbox_id": sandbox_id,
            "started_at": started_at,
            "deadline": started_at + plan.timeout_s,
        }
        row.update(running)
        self.events.publish(RunEvent(row["id"], "state", state=RunState.running.value))
        # Stored a moment later, unless the run has ended by then: its final write then
        # carries the sandbox id, one transaction instead of two.
        record = asyncio.get_running_loop().call_later(
            RUNNING_WRITE_DELAY_S, self._record_running, row["id"], running
        )
        stack.callback(record.cancel)

    async def _exec(
        self,
        sandbox: Sandbox,
        plan: Plan,
        started_at: float,
        sink: OutputSink,
        watch: _Stopwatch,
    ) -> dict[str, Any]:
        """Upload the job's files and run its command for what is left of its timeout;
        the state it ended in (``timed_out`` when the deadline passed)."""
        if plan.files:
            await sandbox.upload(plan.files)
        watch.exec_started = time.monotonic()
        remaining = max(0.0, plan.timeout_s - (time.time() - started_at))
        deadline = asyncio.timeout(remaining)
        result = None
        try:
            async with deadline:
                result = await sandbox.exec(
                    plan.argv,
                    stdin=plan.stdin,
                    env=plan.env,
                    workdir=plan.workdir,
                    timeout_s=remaining,
                    output=sink,
                )
        except TimeoutError:
            if not deadline.expired():
                raise
        watch.timings["exec_ms"] = _ms_since(watch.exec_started)
        if result is None:
            return {"state": RunState.timed_out.value}
        if result.memory_limit_mb is not None:
            return {
                "state": RunState.failed.value,
                "exit_code": result.exit_code,
                "error_code": "out_of_memory",
                "error_message": (
                    f"the job exceeded its memory limit ({result.memory_limit_mb} MiB) "
                    "and was killed"
                ),
            }
        state = RunState.succeeded if result.exit_code == 0 else RunState.failed
        return {"state": state.value, "exit_code": result.exit_code}

    def _measured(
        self, plan: Plan, final: dict[str, Any], sink: OutputSink, watch: _Stopwatch
    ) -> dict[str, Any]:
        """``final`` with what the run cost, and ``watch``'s timings completed."""
        if watch.exec_started is not None and "exec_ms" not in watch.timings:
            watch.timings["exec_ms"] = _ms_since(watch.exec_started)
        if sink.first_output_at is not None:
            watch.timings["first_output_ms"] = int((sink.first_output_at - watch.started) * 1000)
        if watch.sandbox_started is None:
            return final
        # Billed from the create call to the end of terminate: what the provider saw.
        seconds = round(time.monotonic() - watch.sandbox_started, 3)
        resources = plan.spec.resources
        cost = self.costs.cost(plan.provider, resources.cpu, resources.memory_mb, seconds)
        return {**final, "sandbox_s": seconds, "cost_usd": cost}

    def _record_running(self, run_id: str, values: dict[str, Any]) -> None:
        task = asyncio.create_task(self._write_running(run_id, values))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_running(self, run_id: str, values: dict[str, Any]) -> None:
        try:
            written = await self.store.update_run(run_id, **values)
        except Exception as exc:  # the final write will carry the same values
            log.warning(
                "recording a running run failed",
                extra={"run_id": run_id, "error_class": type(exc).__name__},
            )
            return
        if not written and run_id in self._tasks:
            # Made final elsewhere while its sandbox was being created (a DELETE through
            # another replica, which had no sandbox id to terminate): end the sandbox now.
            log.info("run ended elsewhere; ending its sandbox", extra={"run_id": run_id})
            self._stop(run_id, "elsewhere")

    async def _finish(
        self, row: dict[str, Any], final: dict[str, Any], sink: OutputSink, timings: dict[str, int]
    ) -> None:
        """Write the final state once. ``row`` is the run as this task wrote it: if nobody
        else touched it (the usual case) one conditional UPDATE does, and nothing is read."""
        run_id, now = row["id"], time.time()
        started = row.get("started_at")
        values = {
            **final,
            # Written here too in case the deferred `running` write never happened.
            "sandbox_id": row.get("sandbox_id"),
            "started_at": started,
            "stdout": sink.text("stdout"),
            "stderr": sink.text("stderr"),
            "stdout_truncated": sink.truncated("stdout"),
            "stderr_truncated": sink.truncated("stderr"),
            "ended_at": now,
            "duration_ms": int((now - started) * 1000) if started else None,
            "timings": json.dumps(timings),
        }
        finished = await self._write_final(row, values)
        self._output.pop(run_id, None)
        self._tasks.pop(run_id, None)
        self._cancel_reason.pop(run_id, None)
        self._held.discard(run_id)
        event = self._done.pop(run_id, None)
        if event is not None:  # a waiter with no row reads the store instead
            event.row = finished
            event.set()
        if finished is not None:
            self.events.publish(RunEvent(run_id, "finished", state=finished["state"], row=finished))
            log.info("run finished", extra={"run_id": run_id, "state": finished["state"]})

    async def _write_final(
        self, row: dict[str, Any], values: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Store the final ``values``, trying again with backoff while the store refuses
        (a full disk, a database restarting): the run is finished, its outcome must not
        be lost. Meanwhile the outcome is kept in memory (a GET here reads it) and the run
        stays held, so the reaper leaves it alone. Only a shutdown gives up (then the
        reaper of the next process records the run ``lost``); None then."""
        run_id = row["id"]
        callback = row.get("callback_url") is not None
        delay, longest = FINAL_WRITE_RETRY_S
        while True:
            try:
                if await self.store.finish_run(run_id, values, callback=callback):
                    finished: dict[str, Any] | None = {**row, **values}
                else:
                    finished = await self._finish_contended(run_id, values)
            except Exception as exc:
                if self._closing.is_set():
                    log.error(
                        "writing the final state failed; shutting down, so giving up",
                        extra={"run_id": run_id, "error_class": type(exc).__name__},
                    )
                    finished = None
                    break
                self._unwritten[run_id] = {**row, **values}
                log.warning(
                    "writing the final state failed; trying again",
                    extra={
                        "run_id": run_id,
                        "error_class": type(exc).__name__,
                        "retry_in_s": delay,
                    },
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._closing.wait()  # at shutdown: one last try at once
                delay = min(delay * 2, longest)
                continue
            if run_id in self._unwritten:
                del self._unwritten[run_id]
                log.info("final state written after retrying", extra={"run_id": run_id})
            break
        self._unwritten.pop(run_id, None)
        return finished

    async def _finish_contended(self, run_id: str, values: dict[str, Any]) -> dict[str, Any] | None:
        """The run was made final elsewhere (then it stays as it is), or canceled through
        another replica, which terminated the sandbox under us: then it reads canceled,
        unless the job had succeeded anyway."""
        row = await self.store.get_run(run_id)
        if row is None or RunState(row["state"]).final:
            return row
        if values.get("state") != RunState.succeeded.value:
            kept = [
                *("sandbox_id", "started_at", "sandbox_s", "cost_usd"),
                *("ended_at", "duration_ms", "timings"),
                # Everything printed until the cancel stays with the run.
                *("stdout", "stderr", "stdout_truncated", "stderr_truncated"),
            ]
            values = {key: values[key] for key in kept if key in values}
            values |= {"state": RunState.canceled.value}
        if await self.store.update_run(run_id, **values):
            return {**row, **values}
        return await self.store.get_run(run_id)

    # -- reading, waiting, cancelling --------------------------------------------------

    def holds(self, run_id: str) -> bool:
        """Whether this process answers for the run (admitted here, final state not yet
        stored): the reaper must leave it alone."""
        return run_id in self._held

    async def get(self, principal: Principal, run_id: str) -> dict[str, Any]:
        row = self._unwritten.get(run_id)  # finished here, the store not yet told
        if row is None:
            row = await self.store.get_run(run_id)
        if row is None or row["token"] != principal.name:
            raise NotFound("no such run")  # another token's run is as good as absent
        sink = self._output.get(run_id)
        if sink is not None and not RunState(row["state"]).final:
            # Running here: the output so far (kept within the same caps as the final).
            row = {
                **row,
                **{stream: sink.text(stream) for stream in ("stdout", "stderr")},
                **{f"{s}_truncated": sink.truncated(s) for s in ("stdout", "stderr")},
            }
        return row

    async def wait(self, run_id: str, timeout_s: float) -> dict[str, Any]:
        """The run once final, or as it is when ``timeout_s`` has passed."""
        event = self._done.get(run_id)
        end = time.monotonic() + timeout_s
        if event is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
            if event.row is not None:
                return event.row
        while True:
            if run_id in self._unwritten:  # finished; its final write is being retried
                return self._unwritten[run_id]
            row = await self.store.get_run(run_id)
            if row is None:
                raise NotFound("no such run")
            if RunState(row["state"]).final or time.monotonic() >= end:
                return row
            await asyncio.sleep(min(0.25, max(0.0, end - time.monotonic())))

    async def cancel(self, principal: Principal, run_id: str) -> dict[str, Any]:
        row = await self.get(principal, run_id)
        if RunState(row["state"]).final:
            raise RunNotCancelable(details={"run_id": run_id})
        await self.store.update_run(run_id, cancel_requested=True)
        if run_id in self._tasks:
            self._stop(run_id, "canceled")
            await self._closed({run_id})
        else:
            # Held by no task here (another replica, or a relay that died): end the sandbox
            # through the provider, then close the run.
            provider = self.providers.get(row["provider"])
            if row["sandbox_id"] and provider is not None:
                await provider.terminate(row["sandbox_id"])
            ended: dict[str, Any] = {"state": RunState.canceled.value, "ended_at": time.time()}
            if await self.store.update_run(run_id, **ended):
                row = {**row, **ended}
                self.events.publish(RunEvent(run_id, "finished", state=row["state"], row=row))
        return await self.get(principal, run_id)

    # -- shutdown ----------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Stop accepting runs (SIGTERM); running ones get ``RELAY_DRAIN_S`` to finish."""
        if self._drain_started is None:
            self._drain_started = time.monotonic()
        self.accepting = False

    async def shutdown(self) -> None:
        """Let runs finish within the drain time, then cancel the rest and record it."""
        self.begin_drain()
        assert self._drain_started is not None
        remaining = self.settings.drain_s - (time.monotonic() - self._drain_started)
        tasks = set(self._tasks.values())
        if tasks and remaining > 0:
            await asyncio.wait(tasks, timeout=remaining)
        for run_id in list(self._tasks):
            self._stop(run_id, "shutdown")
        # Final writes the store refuses get one more try each, then are given up: the
        # next process's reaper records those runs lost.
        self._closing.set()
        await self._closed(set(self._tasks))
        if self._writes:
            await asyncio.wait(set(self._writes), timeout=self.settings.create_timeout_s)

    def _stop(self, run_id: str, reason: str) -> None:
        if run_id not in self._cancel_reason:
            self._cancel_reason[run_id] = reason
            self._tasks[run_id].cancel()

    async def _closed(self, run_ids: set[str]) -> None:
        """Wait (up to the create timeout) for stopped runs to be written final."""
        tasks = {self._tasks[run_id] for run_id in run_ids if run_id in self._tasks}
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.create_timeout_s)
        for run_id in run_ids:
            task = self._tasks.get(run_id)
            if task is not None and task.done():
                # Cancelled before its first step: its body, and the finally that writes
                # the final state, never ran; no sandbox was made.
                reason = self._cancel_reason.get(run_id, "shutdown")
                row = await self.store.get_run(run_id)
                if row is not None:
                    sink = OutputSink(self.settings.max_output_bytes)
                    await shielded(self._finish(row, _canceled(reason), sink, {}))

    @property
    def active_runs(self) -> int:
        return len(self._tasks)

    async def usage(self, principal: Principal) -> tuple[Usage, Usage]:
        """The token's usage today and this month (UTC)."""
        now = self.clock()
        today = await self.store.usage(principal.name, day_start(now))
        month = await self.store.usage(principal.name, month_start(now))
        return today, month


@dataclass
class _Stopwatch:
    """When a run's steps began (monotonic seconds), and the timings it reports."""

    started: float = field(default_factory=time.monotonic)
    sandbox_started: float | None = None  # the create call: billing starts here
    exec_started: float | None = None
    timings: dict[str, int] = field(default_factory=dict)


def _failure(run_id: str, plan: Plan, final: dict[str, Any], exc: Exception) -> dict[str, Any]:
    """The final state after ``exc`` ended the run's task."""
    if isinstance(exc, RelayError):
        if final:  # the job ended; only terminating failed: the reaper retries it
            log.error(
                "terminate failed",
                extra={"run_id": run_id, "provider": plan.provider, "error_code": exc.code},
            )
            return final
        return {
            "state": RunState.error.value,
            "error_code": exc.code,
            "error_message": exc.message,
            "error_retry_after_s": exc.retry_after,
        }
    log.error(
        "run failed inside the relay",
        extra={"run_id": run_id, "error_class": type(exc).__name__},
    )
    return {
        "state": RunState.error.value,
        "error_code": "internal",
        "error_message": "the relay failed while running this job",
    }


def _canceled(reason: str) -> dict[str, Any]:
    final: dict[str, Any] = {"state": RunState.canceled.value}
    if reason == "shutdown":
        final |= {
            "error_code": "shutting_down",
            "error_message": "the relay shut down before the run ended",
        }
    return final


def _ms_since(start: float) -> int:
    return int((time.monotonic() - start) * 1000)
