"""The reaper: nothing outlives its run's deadline, whatever failed.

Each sweep (at startup and every ``RELAY_REAP_INTERVAL_S``):

1. runs that are not final, not held by this process, and either past their deadline +
   grace or orphaned → their sandbox is terminated and the run reads ``lost``; the run
   service's ``finished`` event is published for it, as for any run that ends (metrics
   count it, the webhook dispatcher is woken, a live events stream ends). A run is
   orphaned when the replica that owns it has stopped its heartbeat (every replica writes
   one every :attr:`Reaper.heartbeat_s`; three missed beats mean it died), judged only
   once this replica has written :data:`BEATS_BEFORE_JUDGING` heartbeats since it last
   failed to reach the store (after an outage every beat is old); on SQLite there
   is one relay, so a run owned by an earlier process is orphaned at once; a run owned
   by this process that it no longer holds (the ``holds`` it is given:
   :meth:`RunService.holds`) is orphaned too;
2. every sandbox a provider lists as this cluster's whose run is final or past its
   deadline + grace → terminated. A sandbox whose run the store does not know is
   terminated only once older than the longest lifetime this relay gives
   (``RELAY_CREATE_TIMEOUT_S`` + ``RELAY_MAX_TIMEOUT_S`` + ``RELAY_GRACE_S``): younger, it
   may be another relay's sharing the cluster name. A ``relay probe`` sandbox (run id
   ``probe_…``) ends itself; it is terminated once past a probe's lifetime. A sandbox
   whose age neither the provider nor the relay's ``relay-created`` tag gives (on Modal,
   one an older relay made) is left alone, counted (``relay_reaper_unknown_age_total``)
   and logged; its own hard lifetime ends it. A provider with no hard lifetime of its own
   (Sprites: its ``limits`` say ``hard_lifetime: false``) relies on this step alone:
   nothing else ever deletes a sandbox a crashed relay left there. A sandbox the provider
   lists as ``abandoned`` (``local``: a group of a relay that died, its lock free; a
   relay's start ends them, ``relay reap`` leaves them to this step) → terminated
   (``abandoned``), whatever its run says.

Warm pools' sandboxes (run tag ``pool_…``, relay/runs/pools.py) are judged by their rows
in the store (relay/store/pools.py), not by a run: the rows of a replica that died (on
SQLite: of an earlier process) are ended and their sandboxes terminated
(``pool_orphaned``); a listed pooled sandbox whose row is ended is terminated
(``pool_ended``), one a run claimed goes with its run like any other, and one with no row
at all once older than the longest a pooled sandbox lives (``pool_unknown_expired``). The
rows this replica holds are its own pools' to end.

Every termination is logged (provider, sandbox, run, reason) and counted by reason
(``relay_reaper_terminations_total{reason}``). A sweep's :class:`SweepReport` also says
what it found and what it left for now, why and until when (:class:`Waiting`), for
``relay reap`` to print. ``sweep(judge_now=True)`` (``relay reap --now``, for an operator
who knows no other relay runs on this database) counts every other replica dead at once,
instead of after its missed heartbeats.

On PostgreSQL one replica sweeps at a time (an advisory lock); terminate is idempotent,
so an overlap would be harmless anyway. A terminate that fails is counted, logged
(provider, sandbox id, error class) and tried again with backoff (the next sweep, then
after 1, 3 and at most 3 skipped sweeps); ``/readyz`` reads degraded until it succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from relay.providers.contract import POOL_PREFIX, Provider, SandboxRef
from relay.providers.probe import PROBE_PREFIX, PROBE_TIMEOUT_S
from relay.run_state import ACTIVE, FINAL, RunState, transition
from relay.runs.costs import CostModel
from relay.runs.event_bus import EventBus, RunEvent
from relay.settings import Settings
from relay.store.database import Store
from relay.store.pools import CLAIMED, ENDED, WAITING, PoolRecord, PoolRows
from relay.store.records import RunRecord

log = logging.getLogger("relay.reaper")

MISSED_BEATS = 3
"""A replica that has written no heartbeat for this many of its beats (plus a second) died."""
CONCURRENT_TERMINATES = 16
"""Terminate calls one sweep makes at a time."""
BEATS_BEFORE_JUDGING = MISSED_BEATS + 1
"""Heartbeats this replica must itself have written since it last failed to reach the
store before it calls another replica dead: after a database outage every replica's last
beat is old, and the others need as long as the rule gives them to write a new one."""


@dataclass(frozen=True)
class Waiting:
    """Something a sweep found and left alone for now: why, and until when it is left
    (Unix seconds; None: no rule of the reaper will end it)."""

    subject: str
    reason: str
    until: float | None


@dataclass
class SweepReport:
    terminated: list[tuple[str, str]] = field(default_factory=list)
    lost_runs: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    active_runs: int = 0
    """Runs not final when the sweep looked."""
    listed: dict[str, int] = field(default_factory=dict)
    """Sandboxes each provider listed as this cluster's."""
    waiting: list[Waiting] = field(default_factory=list)


class Reaper:
    """Finds and ends sandboxes and runs that nobody will end otherwise."""

    def __init__(
        self,
        store: Store,
        providers: Mapping[str, Provider],
        settings: Settings,
        *,
        holds: Callable[[str], bool],
        instance_id: str,
        events: EventBus | None = None,
        grace_s: float,
        single_replica: bool,
        reap_interval_s: float = 60.0,
        beats_before_judging: int = BEATS_BEFORE_JUDGING,
        clock: Callable[[], float] = time.time,
        before_sweep: Callable[[], Awaitable[object]] | None = None,
        beat: Callable[[], str] | None = None,
    ) -> None:
        self.clock = clock
        self.before_sweep = before_sweep
        """Run before each sweep: the spool's replay (relay/runs/spool.py), so an outcome a
        stopped relay on this machine spooled is held before its run could be judged lost."""
        self.beat = beat
        """What each heartbeat carries besides the time (the replica's breakers, as JSON)."""
        self.reap_interval_s = reap_interval_s
        self.store = store
        self.providers = providers
        self.holds = holds
        """Whether a run is held by this process (its runs in flight): left alone."""
        self.instance_id = instance_id
        self.events = events
        self.grace_s = grace_s
        self.single_replica = single_replica
        self.failing: dict[str, int] = {}
        self.last_sweep_at: float | None = None  # wall clock; shown by GET /v1/health
        self._skip: dict[str, int] = {}
        self._sweeps = 0
        self.heartbeat_s = min(10.0, reap_interval_s)
        self.beats_before_judging = beats_before_judging
        self.beats = 0  # heartbeats written since this replica last failed to reach the store
        self.terminated_total = 0
        self.terminated_by_reason: Counter[str] = Counter()
        self.unknown_age_total = 0  # sandboxes left alone: unknown run, no creation time
        self.failures_total = 0
        # The longest a sandbox of this relay can live: the create call, the longest run
        # timeout the relay gives, then the provider-side grace. Younger than that, a
        # sandbox the store does not know may be another relay's (same cluster name) or
        # one whose run row is not visible yet: it is left alone.
        self.max_lifetime_s = settings.create_timeout_s + settings.max_timeout_s + grace_s
        self.probe_lifetime_s = settings.create_timeout_s + PROBE_TIMEOUT_S + grace_s
        self.pool_rows = PoolRows(store)
        self.costs = CostModel(providers, settings.cost_rates)
        # The longest a pooled sandbox lives: created, idle, then a run's longest.
        self.pool_lifetime_s = self.max_lifetime_s + settings.pool_idle_s

    async def _terminate(
        self,
        provider: str,
        sandbox_id: str,
        report: SweepReport,
        *,
        run_id: str | None,
        reason: str,
    ) -> bool:
        if self._skip.get(sandbox_id, 0) > self._sweeps:
            return False  # backing off after failures: try again a few sweeps later
        try:
            await self.providers[provider].terminate(sandbox_id)
        except Exception as exc:
            attempts = self.failing[sandbox_id] = self.failing.get(sandbox_id, 0) + 1
            self._skip[sandbox_id] = self._sweeps + min(2 ** (attempts - 1), 4)
            self.failures_total += 1
            report.failures.append((provider, sandbox_id))
            log.warning(
                "terminate failed; will retry",
                extra={
                    "provider": provider,
                    "sandbox_id": sandbox_id,
                    "error_class": type(exc).__name__,
                },
            )
            return False
        self.failing.pop(sandbox_id, None)
        self._skip.pop(sandbox_id, None)
        self.terminated_total += 1
        self.terminated_by_reason[reason] += 1
        report.terminated.append((provider, sandbox_id))
        log.info(
            "reaper terminated a sandbox",
            extra={
                "provider": provider,
                "sandbox_id": sandbox_id,
                "run_id": run_id,
                "reason": reason,
            },
        )
        return True

    def _reason(self, ref: SandboxRef, run: RunRecord | None, now: float) -> str | None:
        """Why a listed sandbox must end (a label for logs and metrics), or None."""
        if run is not None:
            if run.state in FINAL:
                return "run_final"
            if run.deadline + self.grace_s <= now:
                return "run_expired"
            return None
        probe = (ref.run_id or "").startswith(PROBE_PREFIX)
        if ref.created_at is None:
            # Nothing says how old it is: it may be a live probe or another relay's run.
            self.unknown_age_total += 1
            log.warning(
                "a sandbox with no known run and no creation time is left alone",
                extra={"sandbox_id": ref.sandbox_id, "run_id": ref.run_id},
            )
            return None
        age = now - _seconds(ref.created_at)
        if probe:
            return "probe_expired" if age > self.probe_lifetime_s else None
        return "unknown_expired" if age > self.max_lifetime_s else None

    def _pooled_reason(
        self, ref: SandboxRef, row: PoolRecord | None, run: RunRecord | None, now: float
    ) -> str | None:
        """Why a listed pooled sandbox must end, or None (its holder's pool keeps it)."""
        if row is None:
            if ref.created_at is None:
                self.unknown_age_total += 1
                return None
            age = now - _seconds(ref.created_at)
            return "pool_unknown_expired" if age > self.pool_lifetime_s else None
        if row.state == ENDED:
            return "pool_ended"
        if row.state == CLAIMED and run is not None:
            return self._reason(ref, run, now)
        return None

    async def _end_orphaned_pooled(self, row: PoolRecord, now: float, report: SweepReport) -> None:
        """End a dead replica's pooled sandbox: its row first (so its idle time is
        recorded once), then the sandbox (terminate is idempotent)."""
        rate = self.costs.cost(row.provider, row.cpu, row.memory_mb, 1.0)
        await self.pool_rows.end(row.id, now, rate, states=(*WAITING, CLAIMED))
        if row.sandbox_id and row.provider in self.providers:
            await self._terminate(
                row.provider, row.sandbox_id, report, run_id=row.id, reason="pool_orphaned"
            )

    async def sweep(self, *, dry_run: bool = False, judge_now: bool = False) -> SweepReport:
        """One sweep; ``judge_now``: every other replica counts as dead at once (an
        operator who knows none runs), not only after its missed heartbeats."""
        if self.before_sweep is not None and not dry_run:
            await self.before_sweep()
        async with self.store.sweep_lock() as got:
            if not got:
                return SweepReport()
            report = await self._sweep(dry_run, judge_now)
            if not dry_run:
                self.last_sweep_at = self.clock()
            return report

    async def _sweep(self, dry_run: bool, judge_now: bool = False) -> SweepReport:
        self._sweeps += 1
        report = SweepReport()
        now = self.clock()
        window_s = MISSED_BEATS * self.heartbeat_s + 1
        if judge_now:
            live, judging = {self.instance_id}, True
        else:
            live = await self.store.live_replicas(window_s)
            judging = self.beats >= self.beats_before_judging
        live.add(self.instance_id)
        lost: list[tuple[RunRecord, bool]] = []
        active = await self.store.runs_in_states(ACTIVE)
        report.active_runs = len(active)
        beats = await self.store.replica_beats() if active else {}
        for run in active:
            if self.holds(run.id):
                continue
            if self.single_replica or run.owner == self.instance_id:
                # Not held here: whoever ran it (an earlier process, or a task of this one
                # that ended without its final write) will never write its final state.
                orphaned = True
            else:
                orphaned = judging and run.owner not in live
            if not orphaned and run.deadline + self.grace_s > now:
                report.waiting.append(
                    _run_waiting(run, beats.get(run.owner), self, window_s, judging)
                )
                continue
            lost.append((run, orphaned))
        if lost:
            # Read again: a run that ended while this sweep read the beats (its hold let go
            # after its final write) was read active and is found unheld: no orphan.
            now_known = await self.store.runs_by_id([run.id for run, _ in lost])
            lost = [
                (run, orphaned)
                for run, orphaned in lost
                if (known := now_known.get(run.id)) is not None and known.state not in FINAL
            ]
            report.lost_runs = [run.id for run, _ in lost]
        if not dry_run:
            await self._bounded(
                self._end_lost(run, orphaned, now, report) for run, orphaned in lost
            )
        for row in await self.pool_rows.unended():
            if row.holder == self.instance_id:
                continue  # this process's pools end their own
            if self.single_replica or (judging and row.holder not in live):
                if dry_run:
                    report.terminated.append((row.provider, row.sandbox_id or row.id))
                else:
                    await self._end_orphaned_pooled(row, now, report)
        for name, provider in self.providers.items():
            try:
                owned = await provider.list_owned()
            except Exception as exc:
                log.warning(
                    "listing sandboxes failed",
                    extra={"provider": name, "error_class": type(exc).__name__},
                )
                continue
            report.listed[name] = len(owned)
            tags = [ref.run_id or "" for ref in owned]
            pooled = await self.pool_rows.by_id(
                [tag for tag in tags if tag.startswith(POOL_PREFIX)]
            )
            tagged = tags + [row.run_id or "" for row in pooled.values()]
            ids = [run_id for run_id in tagged if run_id]
            runs = await self.store.runs_by_id(ids)
            ending: list[Awaitable[bool]] = []
            for ref in owned:
                record: PoolRecord | None = None
                why: str | None
                if ref.abandoned:  # its relay died (local's start would have ended it)
                    known, why = runs.get(ref.run_id or ""), "abandoned"
                elif (ref.run_id or "").startswith(POOL_PREFIX):
                    record = pooled.get(ref.run_id or "")
                    known = runs.get(record.run_id or "") if record is not None else None
                    why = self._pooled_reason(ref, record, known, now)
                else:
                    known = runs.get(ref.run_id or "")
                    why = self._reason(ref, known, now)
                if known is not None and self.holds(known.id):
                    continue
                if why is None:
                    if known is None or known.state in FINAL:  # an active run's is said above
                        report.waiting.append(self._sandbox_waiting(name, ref, record, now))
                    continue
                if dry_run:
                    report.terminated.append((name, ref.sandbox_id))
                else:
                    ending.append(
                        self._terminate(name, ref.sandbox_id, report, run_id=ref.run_id, reason=why)
                    )
            await self._bounded(ending)
        return report

    def _sandbox_waiting(
        self, provider: str, ref: SandboxRef, row: PoolRecord | None, now: float
    ) -> Waiting:
        """Why a listed sandbox of no active run is left for now, and until when."""
        subject = f"{provider} sandbox {ref.sandbox_id}"
        if row is not None:
            return Waiting(subject, f"a warm pool's ({row.state}) of relay {row.holder}", None)
        if ref.created_at is None:
            return Waiting(
                subject,
                "of no known run, and the provider gives no creation time: "
                "its own hard lifetime ends it",
                None,
            )
        tag = ref.run_id or ""
        if tag.startswith(POOL_PREFIX):
            lifetime_s, what = self.pool_lifetime_s, "a warm pool's of no known row"
        elif tag.startswith(PROBE_PREFIX):
            lifetime_s, what = self.probe_lifetime_s, "a probe's"
        else:
            lifetime_s, what = self.max_lifetime_s, "of no known run (maybe another relay's)"
        return Waiting(
            subject,
            f"{what}; ended once older than {lifetime_s:.0f} s",
            _seconds(ref.created_at) + lifetime_s,
        )

    async def _bounded(self, work: Iterable[Awaitable[Any]]) -> None:
        """Await every item, at most :data:`CONCURRENT_TERMINATES` at a time (hundreds of
        orphans would take minutes one by one)."""
        gate = asyncio.Semaphore(CONCURRENT_TERMINATES)

        async def one(item: Awaitable[Any]) -> None:
            async with gate:
                await item

        await asyncio.gather(*(one(item) for item in work))

    async def _end_lost(
        self, run: RunRecord, orphaned: bool, now: float, report: SweepReport
    ) -> None:
        if run.sandbox_id and run.provider in self.providers:
            reason = "run_orphaned" if orphaned else "run_expired"
            await self._terminate(
                run.provider, run.sandbox_id, report, run_id=run.id, reason=reason
            )
        marked = await self.store.update_run(
            run.id,
            state=transition(run, RunState.lost),
            ended_at=now,
            error_code="sandbox_lost",
            error_message="the relay running this job stopped; the sandbox was terminated",
        )
        if marked:  # not when its owner finished it meanwhile: that one was published
            await self._publish_lost(run.id)

    async def _publish_lost(self, run_id: str) -> None:
        """Tell this replica's subscribers (metrics, webhooks, live streams) the run ended."""
        if self.events is None:
            return
        run = await self.store.get_run(run_id)
        if run is not None:
            self.events.publish(RunEvent(run_id, "finished", state=run.state, run=run))

    async def run_forever(self, *, sweep_first: bool = False) -> None:
        """Heartbeat every ``heartbeat_s`` and sweep every ``reap_interval_s`` (the first
        time at once with ``sweep_first``: the startup sweep, while the relay serves)."""
        next_sweep = time.monotonic() + (0 if sweep_first else self.reap_interval_s)
        while True:
            try:
                await self.store.heartbeat(self.instance_id, self.beat() if self.beat else None)
                self.beats += 1
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.reap_interval_s
                    await self.sweep()
            except Exception as exc:
                self.beats = 0
                log.warning("sweep failed", extra={"error_class": type(exc).__name__})
            await asyncio.sleep(min(self.heartbeat_s, self.reap_interval_s))

    @property
    def sweeps(self) -> int:
        """Sweeps begun by this process."""
        return self._sweeps

    @property
    def degraded(self) -> bool:
        return bool(self.failing)


def _run_waiting(
    run: RunRecord, beat: float | None, reaper: Reaper, window_s: float, judging: bool
) -> Waiting:
    """Why an active run is left for now: its relay looks alive (or is not judged yet)
    and its deadline + grace has not passed; ended at the earlier of the two."""
    expires = run.deadline + reaper.grace_s
    subject = f"run {run.id}"
    if run.sandbox_id:
        subject += f" ({run.provider} sandbox {run.sandbox_id})"
    if not judging:
        reason = (
            f"owned by relay {run.owner}, not judged until this relay has written "
            f"{reaper.beats_before_judging} heartbeats; lost past its deadline + grace"
        )
        return Waiting(subject, reason, expires)
    age_s = max(0.0, reaper.clock() - (beat or 0.0))
    reason = (
        f"owned by relay {run.owner}, whose last heartbeat was {age_s:.0f} s ago; lost once "
        f"that relay has missed {MISSED_BEATS} beats or its deadline + grace is past"
    )
    return Waiting(subject, reason, min(expires, (beat or 0.0) + window_s))


def _seconds(moment: datetime | float) -> float:
    return moment if isinstance(moment, float | int) else moment.timestamp()
