"""The final writes of the runs that ended in this process, each until the store takes it.

A run's final state is written once (:meth:`FinalWrites.write`). While the store refuses it
(a full disk, a database restarting) the outcome is kept here: a ``GET`` on this replica
reads it (:meth:`~FinalWrites.unwritten`), the run stays held (the runner's), and the limits
this replica enforces no longer count it (:meth:`~FinalWrites.settled`). The write is tried
again with backoff (:data:`RETRY_S`), and at once when the store takes any write of this
process again (:meth:`~FinalWrites.wake`, on the store's answer: relay/store/answering.py),
so a run's slot comes back the moment the store does. At shutdown each write gets one last
try; what the store still refuses goes to the spool (relay/runs/spool.py), which the next
start replays (:meth:`~FinalWrites.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from relay.run_state import RunState, transition
from relay.runs.spool import Spooled
from relay.store.database import Store
from relay.store.records import RunRecord, RunValues

log = logging.getLogger("relay.service")

RETRY_S = (0.1, 5.0)
"""A final write the store refused is tried again after the first figure, doubling up to
the second, until it lands; at once when any write of this process lands meanwhile."""


@dataclass(frozen=True)
class _Unwritten:
    run: RunRecord
    """The run as its task wrote it."""
    values: RunValues
    final: RunRecord
    """The run with its final values: what a GET here answers."""


class FinalWrites:
    """The final writes in flight and the outcomes the store has not taken yet."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._unwritten: dict[str, _Unwritten] = {}
        self._woken = asyncio.Event()
        self._closed = asyncio.Event()
        self.closing = False
        """Set at shutdown: a refused write gives up (its outcome goes to the spool)."""
        store.answer.listen(self.wake)

    def unwritten(self, run_id: str) -> RunRecord | None:
        """The run, final, if the store has not taken its final write yet."""
        kept = self._unwritten.get(run_id)
        return kept.final if kept is not None else None

    @property
    def refused(self) -> int:
        """Outcomes the store has refused and not taken since (``/readyz`` reads it)."""
        return len(self._unwritten)

    def settled(self) -> dict[str, float]:
        """The runs the store still counts running though their outcome is known here,
        with what each cost (relay/store/limits.py takes them off)."""
        return {run_id: kept.final.cost_usd for run_id, kept in self._unwritten.items()}

    def pending(self) -> list[Spooled]:
        """The outcomes the store has not taken: what a stopping relay spools."""
        return [Spooled(kept.run, kept.values) for kept in self._unwritten.values()]

    def forget(self, run_ids: list[str]) -> None:
        """Answer no more for these outcomes: spooled, the next start has them."""
        for run_id in run_ids:
            self._unwritten.pop(run_id, None)

    def adopt(self, spooled: Spooled) -> None:
        """Answer for an outcome from the spool as for one that ended here."""
        self._unwritten[spooled.run.id] = _Unwritten(spooled.run, spooled.values, spooled.final)

    def wake(self) -> None:
        """Let every write waiting out its backoff try again now."""
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def close(self) -> None:
        """Shutting down: each write waiting tries once more at once, then gives up."""
        self.closing = True
        self._closed.set()
        self.wake()

    async def write(
        self,
        run: RunRecord,
        values: RunValues,
        refused: Callable[[RunRecord], None] = lambda final: None,
    ) -> RunRecord | None:
        """Store the final ``values`` of ``run`` (the run as its task wrote it); the run
        as stored. While the store refuses, the outcome is kept (``refused`` is told it
        once) and the write tried again; at shutdown it gives up: None, the outcome left
        for the spool (:meth:`pending`)."""
        run_id = run.id
        delay, longest = RETRY_S
        wakeable = True
        while True:
            woken = self._woken  # before trying: the store back meanwhile ends the wait
            try:
                finished = await self._write_once(run, values)
            except Exception as exc:
                if run_id not in self._unwritten:
                    self._unwritten[run_id] = _Unwritten(run, values, run.changed(**values))
                    refused(self._unwritten[run_id].final)
                if self.closing:
                    log.error(
                        "writing the final state failed; shutting down, so it goes to the spool",
                        extra={"run_id": run_id, "error_class": type(exc).__name__},
                    )
                    return None
                log.warning(
                    "writing the final state failed; trying again",
                    extra={
                        "run_id": run_id,
                        "error_class": type(exc).__name__,
                        "retry_in_s": delay,
                    },
                )
                # A store that takes some writes and refuses this one (a disk with room for
                # a heartbeat, not for this output) wakes it once, not on every write.
                waiting = woken if wakeable else self._closed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await waiting.wait()
                wakeable = not (wakeable and woken.is_set())
                delay = min(delay * 2, longest)
                continue
            if self._unwritten.pop(run_id, None) is not None:
                log.info("final state written after retrying", extra={"run_id": run_id})
            return finished

    async def _write_once(self, run: RunRecord, values: RunValues) -> RunRecord | None:
        callback = run.callback_url is not None
        if await self.store.finish_run(run.id, values, callback=callback):
            return run.changed(**values)
        return await self._finish_contended(run.id, values)

    async def _finish_contended(self, run_id: str, values: RunValues) -> RunRecord | None:
        """The run was made final elsewhere (then it stays as it is), or canceled through
        another replica, which terminated the sandbox under us: then it reads canceled,
        unless the job had succeeded anyway."""
        run = await self.store.get_run(run_id)
        if run is None or run.state.final:
            return run
        if values.get("state") != RunState.succeeded:
            kept: RunValues = {"state": transition(run, RunState.canceled)}
            for key in _KEPT_WHEN_CANCELED:
                if key in values:
                    kept[key] = values[key]  # type: ignore[literal-required]
            values = kept
        if await self.store.update_run(run_id, **values):
            return run.changed(**values)
        return await self.store.get_run(run_id)


_KEPT_WHEN_CANCELED = (
    *("sandbox_id", "provider", "attempts", "started_at", "sandbox_s", "cost_usd"),
    *("ended_at", "duration_ms", "timings"),
    # Everything printed until the cancel stays with the run, and the files it kept.
    *("stdout", "stderr", "stdout_truncated", "stderr_truncated", "artifacts"),
)
"""What a run canceled through another replica keeps of what its task measured."""
