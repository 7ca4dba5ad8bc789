"""A breaker per provider: routes skip a provider that keeps failing its creates.

Each replica keeps its own, in memory (the README says why: no store round trip on a run's
path, each replica learns within a few failures of its own, and a store outage does not
blind routing). A breaker is:

- **closed** (routes try the provider) until ``RELAY_BREAKER_FAILURES`` creates in a row
  fail, or ``RELAY_BREAKER_FAILURE_RATE`` of the creates over ``RELAY_BREAKER_WINDOW_S``
  fail (of at least twice ``RELAY_BREAKER_FAILURES`` creates); then
- **open**: routes skip the provider without an attempt, for ``RELAY_BREAKER_COOLDOWN_S``;
  then
- **half-open**: exactly one run tries it; a create that works closes the breaker, one that
  fails opens it again for another cool-down.

What counts: a provider's fault at a create (unavailable, timeout, refused credentials,
rate limit or quota) or a sandbox lost before its command started; never a request's own
fault (its size, its egress, an image the provider does not have, any other 4xx answer the
adapter has no name for: :class:`~relay.errors.ProviderRefused`) nor the job's exit. A run
whose route holds one provider does not go through a route, so it neither asks the breaker
nor counts (it has nowhere else to go).

:class:`~relay.runs.capacity.Capacity` sits beside the breaker: whether a provider can
take one more run (``RELAY_<NAME>_MAX_CONCURRENT``).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from relay.settings import Settings


class BreakerState(StrEnum):
    """Where a provider's breaker stands (``relay_provider_breaker_state``: 0, 1, 2)."""

    closed = "closed"
    half_open = "half_open"
    open = "open"

    @property
    def number(self) -> int:
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


@dataclass
class Breaker:
    """One provider's breaker and what it has counted on this replica."""

    state: BreakerState = BreakerState.closed
    consecutive: int = 0
    """Failed creates in a row (a success starts it again)."""
    opened_at: float | None = None
    """When it last opened (the clock's seconds); None while it never has."""
    trying: bool = False
    """Half-open, and the one run allowed to try is trying."""
    opened: int = 0
    """How many times it opened."""
    recent: collections.deque[tuple[float, bool]] = field(default_factory=collections.deque)
    """(when, failed) of the creates within the window."""
    attempts: collections.Counter[str] = field(default_factory=collections.Counter)
    """Attempts on it by outcome: ``ok`` or the error code."""
    failovers: collections.Counter[str] = field(default_factory=collections.Counter)
    """Runs that moved on from it to the next provider, by the error code."""


class Breakers:
    """Every provider's breaker on this replica (made on first use)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = settings.breaker_failures
        self.failure_rate = settings.breaker_failure_rate
        self.window_s = settings.breaker_window_s
        self.cooldown_s = settings.breaker_cooldown_s
        self.clock = clock
        self._breakers: dict[str, Breaker] = {}

    def of(self, provider: str) -> Breaker:
        breaker = self._breakers.get(provider)
        if breaker is None:
            breaker = self._breakers[provider] = Breaker()
        return breaker

    def state(self, provider: str) -> BreakerState:
        """Its state now (an open breaker past its cool-down reads half-open)."""
        breaker = self.of(provider)
        if breaker.state is BreakerState.open and self._cooled(breaker):
            return BreakerState.half_open
        return breaker.state

    def closed(self, provider: str) -> bool:
        """Whether routes try it freely (a warm pool's claim asks this: it takes no trial)."""
        return self.of(provider).state is BreakerState.closed

    def admits(self, provider: str) -> bool:
        """Whether a route may try it now. Past an open breaker's cool-down the caller is
        the one run that tries it (half-open): it must report how it went (:meth:`passed`,
        :meth:`failed` or :meth:`released`)."""
        breaker = self.of(provider)
        if breaker.state is BreakerState.closed:
            return True
        if breaker.trying or not self._cooled(breaker):
            return False
        breaker.state, breaker.trying = BreakerState.half_open, True
        return True

    def cooldown_left(self, provider: str) -> float:
        """Seconds until an open breaker lets a run try its provider again."""
        breaker = self.of(provider)
        if breaker.opened_at is None or breaker.state is BreakerState.closed:
            return 0.0
        return max(0.0, breaker.opened_at + self.cooldown_s - self.clock())

    def passed(self, provider: str) -> None:
        """A create on it worked: the breaker closes."""
        breaker = self.of(provider)
        breaker.attempts["ok"] += 1
        self._note(breaker, failed=False)
        breaker.state, breaker.trying, breaker.consecutive = BreakerState.closed, False, 0

    def failed(self, provider: str, code: str) -> None:
        """A create on it failed by the provider's fault (``code``), or its sandbox was lost
        before the command started."""
        breaker = self.of(provider)
        breaker.attempts[code] += 1
        self._note(breaker, failed=True)
        breaker.consecutive += 1
        if breaker.state is BreakerState.half_open or self._tripped(breaker):
            self._open(breaker)

    def released(self, provider: str, code: str | None = None) -> None:
        """An attempt it admitted ended without saying anything of the provider (the run was
        canceled, the request was at fault, the run's create budget ran out): a half-open
        breaker lets the next run try instead."""
        breaker = self.of(provider)
        if code is not None:
            breaker.attempts[code] += 1
        if breaker.trying:
            breaker.state, breaker.trying = BreakerState.open, False

    def moved_on(self, provider: str, code: str) -> None:
        """A run left it for the next provider of its route after ``code``."""
        self.of(provider).failovers[code] += 1

    def known(self, names: Iterable[str] = ()) -> dict[str, Breaker]:
        """The breakers of ``names`` and of every provider counted so far."""
        for name in names:
            self.of(name)
        return dict(self._breakers)

    def snapshot(self, names: Iterable[str] = ()) -> str:
        """Every breaker's state and failures in a row, as JSON: what the replica's
        heartbeat carries for ``relay probe``."""
        return json.dumps(
            {
                name: {"state": self.state(name).value, "consecutive_failures": b.consecutive}
                for name, b in sorted(self.known(names).items())
            },
            separators=(",", ":"),
        )

    def _cooled(self, breaker: Breaker) -> bool:
        return breaker.opened_at is not None and (
            self.clock() - breaker.opened_at >= self.cooldown_s
        )

    def _note(self, breaker: Breaker, *, failed: bool) -> None:
        now = self.clock()
        recent = breaker.recent
        recent.append((now, failed))
        while recent and recent[0][0] < now - self.window_s:
            recent.popleft()

    def _tripped(self, breaker: Breaker) -> bool:
        if breaker.consecutive >= self.failures:
            return True
        recent = breaker.recent
        if len(recent) < 2 * self.failures:
            return False
        failed = sum(1 for _, bad in recent if bad)
        return failed / len(recent) >= self.failure_rate

    def _open(self, breaker: Breaker) -> None:
        breaker.state, breaker.trying = BreakerState.open, False
        breaker.opened_at = self.clock()
        breaker.opened += 1
        breaker.recent.clear()  # the next verdict is the half-open run's
