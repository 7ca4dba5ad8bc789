"""The runs in flight: each admitted run in a task of its own, and its final write.

The :class:`Runner` starts a run's task (its steps: relay/runs/run_task.py), writes its
final state once (relay/runs/final_writes.py: retried while the store refuses, spooled at
shutdown if it still does, relay/runs/spool.py), and keeps what this process knows of its
runs in flight: which it holds (the reaper leaves those alone), their output so far, final
states the store has not taken yet. At start it replays the spool an earlier relay left
(:meth:`Runner.replay`). The public side (submit, get, wait, cancel) is
relay/runs/service.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping

from relay.cancellation import Alarms, shielded
from relay.providers.contract import OutputSink, SandboxSource
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.final_writes import FinalWrites
from relay.runs.planning import Plan
from relay.runs.route import Route, Routing
from relay.runs.run_task import RunTask, canceled
from relay.runs.spool import Spool, Spooled
from relay.settings import Settings
from relay.store.artifacts import Artifacts
from relay.store.database import Store, is_store_failure
from relay.store.objects import Objects
from relay.store.records import RunRecord, RunValues

log = logging.getLogger("relay.service")


class _Done:
    """Set once, when a run is final; carries the final record so a waiter needn't read it
    again. Waiting is bounded by an alarm (the runner's, one timer of the loop's for every
    waiter), not a cancel scope: a run answered at once (``wait``) waits through this on
    every request."""

    def __init__(self, alarms: Alarms, loop: asyncio.AbstractEventLoop) -> None:
        self.run: RunRecord | None = None
        self._set = False
        self._waiters: list[asyncio.Future[None]] = []
        self._alarms = alarms
        # The run's loop, where it is set: a waiter from another loop could not be woken
        # (nor was it before); held, its `get_running_loop` (a `getpid`) is saved a wait.
        self._loop = loop

    def set(self) -> None:
        self._set = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until set, or ``timeout_s`` has passed."""
        if self._set:
            return
        loop = self._loop
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        self._alarms.set_on(loop, waiter, timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            self._alarms.clear(waiter)
            self._waiters.remove(waiter)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Runner:
    """Runs admitted runs, and answers for them until their final state is stored."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        sources: Mapping[str, SandboxSource],
        events: EventBus,
        costs: CostModel,
        routing: Routing | None = None,
        objects: Objects | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.sources = sources
        """Each provider's door (relay/runs/sources.py): the provider, or it behind its
        warm pools."""
        self.routing = routing
        """What the routes of runs with several providers share (relay/runs/route.py)."""
        self.events = events
        self.costs = costs
        self.artifacts = Artifacts(store, objects)
        """Where runs' artifacts are kept (relay/store/artifacts.py; their contents in
        object storage with RELAY_ARTIFACTS_URL, relay/store/objects.py)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._done: dict[str, _Done] = {}
        self._cancel_reason: dict[str, str] = {}
        # Runs whose task is still in its steps (or not started): only those are cancelled
        # by stop(). Once the steps end the task writes the final state, which no
        # cancellation interrupts; a shield around it would cost a task per run.
        self._stepping: set[str] = set()
        self._writes: set[asyncio.Task[None]] = set()  # deferred `running` writes in flight
        # Bounds alike for every run, each kind on one timer of the loop's, not one a run:
        # a kind of its own each (one delay each), so each is due in the order it was set.
        self.waits = Alarms()  # the callers' waits (the same `max_wait_s` each)
        self.running_writes = Alarms()  # the deferred `running` writes
        # Runs this process answers for: from admission until their final state is stored
        # (or given up at shutdown). The reaper leaves them alone; any other active run
        # owned by this process is an orphan (its task died without a final write).
        self._held: set[str] = set()
        self.spool = Spool(settings.state_directory() / "spool", settings.spool_max_bytes)
        # Final writes, and the outcomes the store has refused so far (kept until it takes
        # them, spooled at shutdown).
        self.finals = FinalWrites(store)
        self._replaying: set[asyncio.Task[None]] = set()  # spooled outcomes being written
        self._output: dict[str, OutputSink] = {}  # running runs' output so far, for a GET
        # Set once the shutdown has closed what it could: a run still ending then (its
        # provider not answering the terminate) is no longer waited for.
        self.stopped = False

    # -- what the service asks ---------------------------------------------------------

    def hold(self, run_id: str) -> None:
        """Answer for ``run_id`` from now on (before its row exists: a sweep meanwhile
        must not call it orphaned)."""
        self._held.add(run_id)

    def release(self, run_id: str) -> None:
        """Answer no more for a run that was not admitted after all."""
        self._held.discard(run_id)

    def holds(self, run_id: str) -> bool:
        return run_id in self._held

    def start(self, plan: Plan, run: RunRecord) -> None:
        """Run ``plan`` for the admitted ``run`` in a task of its own."""
        # The loop is looked up once a run (on Python 3.11 each `get_running_loop`, and
        # `asyncio.create_task`'s, is a `getpid` system call): the run's task, its waiters
        # and its bounds are all on it.
        loop = asyncio.get_running_loop()
        self._done[run.id] = _Done(self.waits, loop)
        self._stepping.add(run.id)
        self._tasks[run.id] = loop.create_task(self._execute(plan, run, loop), name=run.id)

    def running(self, run_id: str) -> bool:
        """Whether a task of this process runs ``run_id``."""
        return run_id in self._tasks

    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of the runs running here."""
        return list(self._tasks.values())

    def unwritten(self, run_id: str) -> RunRecord | None:
        """The run finished here whose final state the store has not taken yet."""
        return self.finals.unwritten(run_id)

    def settled(self) -> dict[str, float]:
        """The runs whose outcome is known here but not stored yet, with their cost: the
        limits this replica enforces take them off what the store counts."""
        return self.finals.settled()

    def output(self, run_id: str) -> OutputSink | None:
        """A running run's output so far."""
        return self._output.get(run_id)

    async def finished(self, run_id: str, timeout_s: float) -> RunRecord | None:
        """The run once final, if it runs here and ends within ``timeout_s``."""
        event = self._done.get(run_id)
        if event is None:
            return None
        await event.wait(timeout_s)
        return event.run

    def stop(self, run_id: str, reason: str) -> None:
        """Cancel the run's steps; ``reason`` (canceled, shutdown, elsewhere) says why. A
        run whose steps have ended is being written final: it is left to finish."""
        if run_id not in self._cancel_reason:
            self._cancel_reason[run_id] = reason
            if run_id in self._stepping:
                self._tasks[run_id].cancel()

    async def closed(self, run_ids: set[str]) -> None:
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
                try:
                    run = await self.store.get_run(run_id)
                except Exception as exc:
                    if not is_store_failure(exc):
                        raise
                    # The store down at shutdown: its row stays as admitted, and the next
                    # process's reaper records it lost (it never had a sandbox).
                    log.warning("could not read a canceled run", extra={"run_id": run_id})
                    continue
                if run is not None:
                    # Final already (ended through another replica, or reaped): nothing
                    # to write; _finish finds it so and lets the run go.
                    final = {} if run.state.final else canceled(run, reason)
                    sink = OutputSink(self.settings.max_output_bytes)
                    await shielded(self._finish(run, final, sink, {}))

    async def shutdown(self, drain_s: float) -> None:
        """Let runs finish within ``drain_s``, then cancel the rest and record it."""
        tasks = set(self._tasks.values())
        if tasks and drain_s > 0:
            await asyncio.wait(tasks, timeout=drain_s)
        for run_id in list(self._tasks):
            self.stop(run_id, "shutdown")
        # Final writes the store refuses get one more try each, then go to the spool,
        # which the next start replays before its reaper marks anything lost.
        self.finals.close()
        await self.closed(set(self._tasks))
        for pending in (self._writes, self._replaying):
            if pending:
                await asyncio.wait(set(pending), timeout=self.settings.create_timeout_s)
        # On the loop's thread (no store write of this relay meanwhile). Twice at a SIGTERM
        # (the server's drain, then the relay's end): spooled once.
        self.finals.forget(self.spool.write(self.finals.pending()))
        # Runs still ending now (a terminate the provider does not answer) would hold their
        # `wait` callers until the server cancels them (a bare 500): they get the run as it
        # is, before the listener closes.
        self.stopped = True
        for event in self._done.values():
            event.set()

    # -- the run -----------------------------------------------------------------------

    def door_for(self, plan: Plan) -> SandboxSource:
        """Where the plan's run opens its sandbox: its provider's door, or a route over its
        providers when it has several (relay/runs/route.py)."""
        if len(plan.route) > 1 and self.routing is not None:
            return Route(plan, self.routing)
        return self.sources[plan.provider]

    async def _execute(self, plan: Plan, run: RunRecord, loop: asyncio.AbstractEventLoop) -> None:
        """Run the plan for ``run`` (the run as admitted) in this task on ``loop``, then
        write its final state."""
        task = RunTask(
            plan,
            run,
            loop=loop,
            settings=self.settings,
            door=self.door_for(plan),
            events=self.events,
            costs=self.costs,
            record_running=self._record_running,
            alarms=self.running_writes,
            artifact_store=self.artifacts,
        )
        self._output[run.id] = task.sink
        final: RunValues = {}
        cancelled = False
        try:
            final = await task.steps()
        except asyncio.CancelledError:
            reason = self._cancel_reason.get(run.id, "shutdown")
            # Stopped after the job ended (during its terminate), by the relay's shutdown
            # or a DELETE that came too late to stop anything: the job's outcome stands, as
            # a DELETE of a finished run leaves it. Either way the run keeps the files it
            # kept.
            final = {**(task.outcome or canceled(task.run, reason)), **task.collected}
            cancelled = True
        finally:
            # From here stop() leaves the task alone (the flag changes while this task
            # runs, so no cancellation requested before can arrive after it): the final
            # write is never interrupted.
            self._stepping.discard(run.id)
            if cancelled:
                current = asyncio.current_task()
                assert current is not None
                current.uncancel()
            final = task.measured(final)
            await self._finish(task.run, final, task.sink, task.watch.timings)
        if cancelled:
            raise asyncio.CancelledError

    def _record_running(self, run_id: str, values: RunValues) -> None:
        task = asyncio.create_task(self._write_running(run_id, values))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_running(self, run_id: str, values: RunValues) -> None:
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
            self.stop(run_id, "elsewhere")

    # -- the spool an earlier relay left ------------------------------------------------

    def prepare_spool(self) -> None:
        """Keep the spool's room reserved on disk (relay/runs/spool.py)."""
        self.spool.reserve()

    async def replay(self) -> list[str]:
        """Write the outcomes an earlier relay spooled (those not taken up already): held
        from now on, so no reaper marks them lost; each tried once now, then, if the store
        still refuses, as any final write (its file goes once the store has it). The run
        ids taken up."""
        adopted = await asyncio.to_thread(self.spool.load, self.finals.settled())
        for spooled in adopted:
            self._held.add(spooled.run.id)
            self.finals.adopt(spooled)
            log.info("replaying a spooled outcome", extra={"run_id": spooled.run.id})
        tasks = [asyncio.create_task(self._replayed(spooled)) for spooled in adopted]
        self._replaying.update(tasks)
        for task in tasks:
            task.add_done_callback(self._replaying.discard)
        if tasks:  # most land at once; those the store refuses go on beside serving
            await asyncio.wait(tasks, timeout=self.settings.create_timeout_s)
        return [spooled.run.id for spooled in adopted]

    async def _replayed(self, spooled: Spooled) -> None:
        run_id = spooled.run.id
        finished = await self.finals.write(spooled.run, spooled.values)
        if finished is None:
            return  # shutting down: it is spooled again
        self.spool.remove(run_id)
        self._held.discard(run_id)
        if finished.state != spooled.values.get("state"):
            log.warning(
                "a spooled outcome was not written: the run had ended otherwise meanwhile",
                extra={"run_id": run_id, "state": finished.state},
            )
        self.events.publish(RunEvent(run_id, "finished", state=finished.state, run=finished))

    async def _finish(
        self, run: RunRecord, final: RunValues, sink: OutputSink, timings: dict[str, int | bool]
    ) -> None:
        """Write the final state once. ``run`` is the run as this task wrote it: if nobody
        else touched it (the usual case) one conditional UPDATE does, and nothing is read."""
        run_id, now, started = run.id, time.time(), run.started_at
        values: RunValues = {
            **final,
            # Written here too in case the deferred `running` write never happened.
            "sandbox_id": run.sandbox_id,
            "started_at": started,
            "stdout": sink.text("stdout"),
            "stderr": sink.text("stderr"),
            "stdout_truncated": sink.truncated("stdout"),
            "stderr_truncated": sink.truncated("stderr"),
            "ended_at": now,
            "duration_ms": int((now - started) * 1000) if started else None,
            "timings": _timings_json(timings),
        }
        finished = await self._write_final(run, values)
        self._output.pop(run_id, None)
        self._tasks.pop(run_id, None)
        self._stepping.discard(run_id)
        self._cancel_reason.pop(run_id, None)
        self._held.discard(run_id)
        event = self._done.pop(run_id, None)
        if event is not None:  # a waiter with no record reads the store instead
            event.run = finished
            event.set()
        if finished is not None:
            self.events.publish(RunEvent(run_id, "finished", state=finished.state, run=finished))
            log.info("run finished", extra={"run_id": run_id, "state": finished.state})

    async def _write_final(self, run: RunRecord, values: RunValues) -> RunRecord | None:
        """Store the final ``values`` (relay/runs/final_writes.py). While the store refuses
        them the run stays held, so the reaper leaves it alone, and a caller held on
        ``wait`` gets the outcome at once, not when the store is back (or its wait runs
        out): the run is over either way. None at shutdown, the outcome spooled."""

        def refused(final: RunRecord) -> None:
            event = self._done.get(run.id)
            if event is not None and event.run is None:
                event.run = final
                event.set()

        return await self.finals.write(run, values, refused)


def _timings_json(timings: Mapping[str, int | bool]) -> str:
    """``json.dumps(timings)``, the same text, for the flat object of whole milliseconds and
    flags a run's timings are, in a third of its time (every run writes one)."""
    parts = []
    for name, value in timings.items():
        if value is True:
            text = "true"
        elif value is False:
            text = "false"
        elif type(value) is int:
            text = str(value)
        else:  # not a run's timing: json's own text
            return json.dumps(timings)
        parts.append(f'"{name}": {text}')
    return "{" + ", ".join(parts) + "}"
