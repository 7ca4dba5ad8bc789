"""The reaper: nothing outlives its run's deadline, whatever failed.

Each sweep (at startup and every ``RELAY_REAP_INTERVAL_S``):

1. runs that are not final, not held by this process, and either past their deadline +
   grace or orphaned (on SQLite there is one relay, so a run owned by an earlier process
   is orphaned) → their sandbox is terminated and the run reads ``lost``;
2. every sandbox a provider lists as this cluster's whose run is final, unknown to the
   store, or past its deadline + grace → terminated.

A terminate that fails is counted, logged (provider, sandbox id, error class) and tried
again on the next sweep; ``/readyz`` reads degraded until it succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from relay.models import RunState
from relay.providers.base import Provider
from relay.service import RunService
from relay.store import FINAL, Store

log = logging.getLogger("relay.reaper")
ACTIVE = ("queued", "starting", "running")


@dataclass
class SweepReport:
    terminated: list[tuple[str, str]] = field(default_factory=list)
    lost_runs: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)


class Reaper:
    """Finds and ends sandboxes and runs that nobody will end otherwise."""

    def __init__(
        self,
        store: Store,
        providers: Mapping[str, Provider],
        service: RunService,
        *,
        grace_s: float,
        single_replica: bool,
    ) -> None:
        self.store = store
        self.providers = providers
        self.service = service
        self.grace_s = grace_s
        self.single_replica = single_replica
        self.failing: dict[str, int] = {}
        self.terminated_total = 0
        self.failures_total = 0

    def _held_here(self, run_id: str) -> bool:
        return run_id in self.service._tasks

    async def _terminate(self, provider: str, sandbox_id: str, report: SweepReport) -> bool:
        try:
            await self.providers[provider].terminate(sandbox_id)
        except Exception as exc:
            self.failing[sandbox_id] = self.failing.get(sandbox_id, 0) + 1
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
        self.terminated_total += 1
        report.terminated.append((provider, sandbox_id))
        return True

    async def sweep(self, *, dry_run: bool = False) -> SweepReport:
        report = SweepReport()
        now = time.time()
        for row in await self.store.runs_in_states(ACTIVE):
            if self._held_here(row["id"]):
                continue
            orphaned = self.single_replica and row["owner"] != self.service.instance_id
            if not orphaned and row["deadline"] + self.grace_s > now:
                continue
            report.lost_runs.append(row["id"])
            if dry_run:
                continue
            if row["sandbox_id"] and row["provider"] in self.providers:
                await self._terminate(row["provider"], row["sandbox_id"], report)
            await self.store.update_run(
                row["id"],
                state=RunState.lost.value,
                ended_at=now,
                error_code="sandbox_lost",
                error_message="the relay running this job stopped; the sandbox was terminated",
            )
        for name, provider in self.providers.items():
            try:
                owned = await provider.list_owned()
            except Exception as exc:
                log.warning(
                    "listing sandboxes failed",
                    extra={"provider": name, "error_class": type(exc).__name__},
                )
                continue
            runs = await self.store.runs_by_id([ref.run_id for ref in owned if ref.run_id])
            for ref in owned:
                run = runs.get(ref.run_id or "")
                if run is not None and self._held_here(run["id"]):
                    continue
                expired = run is not None and run["deadline"] + self.grace_s <= now
                if run is None or run["state"] in FINAL or expired:
                    if dry_run:
                        report.terminated.append((name, ref.sandbox_id))
                    else:
                        await self._terminate(name, ref.sandbox_id, report)
        return report

    async def run_forever(self, interval_s: float) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.sweep()
            await asyncio.sleep(interval_s)

    @property
    def degraded(self) -> bool:
        return bool(self.failing)
