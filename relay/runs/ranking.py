"""How a run's route is ordered before it is tried: the job's ``route`` (or
``RELAY_ROUTE_CHOICE`` for a run whose job names none).

- ``order``: as written (the job's ``providers``, else ``RELAY_ROUTE``);
- ``cheapest``: by what the run would cost at each provider's rates (``RELAY_COST_RATES``
  over the list prices) for its size and whole timeout;
- ``fastest``: by each provider's recent median create time on this relay (every replica's
  runs, read from the store: relay/store/latency.py). A provider with no recent create
  comes after the measured ones.

Ties, and unmeasured providers, keep the written order. Ranking reads memory only: the
create times are read again in the background at most every
``RELAY_ROUTE_LATENCY_REFRESH_S``, and only once a ``fastest`` route asks for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from relay.runs.costs import CostModel
from relay.runs.planning import Plan

log = logging.getLogger("relay.ranking")

LATENCY_WINDOW_S = 3600.0
"""How far back the create times are weighed (the latest 1000 runs of it, at most)."""


class Ranking:
    """Orders runs' routes; keeps the providers' create times for ``fastest``."""

    def __init__(
        self,
        costs: CostModel,
        read_latencies: Callable[[float], Awaitable[dict[str, int]]],
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.costs = costs
        self.read_latencies = read_latencies
        self.refresh_s = refresh_s
        self.clock = clock
        self.create_p50_ms: dict[str, int] = {}
        """Each provider's recent median create time (ms), as last read."""
        self.read_at: float | None = None
        self._reading: asyncio.Task[None] | None = None

    def ranked(self, plan: Plan) -> Plan:
        """``plan`` with its route in the order its ranking says (its first provider and
        spec the new first's)."""
        route = plan.route
        if plan.ranking == "order" or len(route) < 2:
            return plan
        if plan.ranking == "cheapest":
            resources, seconds = plan.spec.resources, plan.timeout_s
            keys = [
                self.costs.cost(c.provider, resources.cpu, resources.memory_mb, seconds)
                for c in route
            ]
        else:
            self.refresh()
            latest = self.create_p50_ms
            keys = [float(latest.get(c.provider, float("inf"))) for c in route]
        order = sorted(range(len(route)), key=lambda index: keys[index])  # stable: ties keep
        ordered = tuple(route[index] for index in order)
        return replace(plan, route=ordered, provider=ordered[0].provider, spec=ordered[0].spec)

    def refresh(self) -> None:
        """Read the create times again in the background if they are older than
        ``refresh_s`` (and no reading is under way); the ranking goes on with the last."""
        now = self.clock()
        if self._reading is not None or (
            self.read_at is not None and now - self.read_at < self.refresh_s
        ):
            return
        self.read_at = now
        self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            self.create_p50_ms = await self.read_latencies(time.time() - LATENCY_WINDOW_S)
        except Exception as exc:  # the store is away: rank by the last reading
            log.warning(
                "reading the providers' create times failed",
                extra={"error_class": type(exc).__name__},
            )
        finally:
            self._reading = None

    async def fresh(self) -> dict[str, int]:
        """The create times, read again first if they are older than ``refresh_s`` (for
        ``/v1/health``: an operator's read, not a run's)."""
        self.refresh()
        reading = self._reading
        if reading is not None:
            await asyncio.shield(reading)
        return self.create_p50_ms

    async def aclose(self) -> None:
        """Wait for a reading under way (the store closes after)."""
        reading = self._reading
        if reading is not None:
            await asyncio.gather(reading, return_exceptions=True)
