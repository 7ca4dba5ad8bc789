"""A route: one door over several providers, tried in order until one runs the command.

A :class:`Route` is a sandbox source of a provider's shape (``sandbox(spec)`` → a live
sandbox, always ended), built per run by the runner (``Runner.door_for``) when the run's
plan has more than one provider. The run task opens it like any door and never knows it
holds one. What it does:

1. takes the plan's candidates as ranked at the admission (relay/runs/ranking.py: order,
   fastest, cheapest; a provider at its cap then was left out), and skips a provider whose
   breaker is open (relay/runs/breakers.py) or that is at its cap of runs at once by now
   (relay/runs/capacity.py) without an attempt;
2. claims a ready warm sandbox on any provider of the route, in route order, before a
   cold create anywhere (a claim is a read of this replica's memory, then one UPDATE);
3. creates on each provider in turn, each create bounded by its provider's create timeout
   and all of them together by the run's create budget (``RELAY_ROUTE_CREATE_BUDGET_S``).
   A create that fails by the provider's fault (5xx, timeout, rate limit or quota, refused
   credentials) moves the run to the next provider; its sweep runs aside, not before the
   next attempt (:data:`~relay.providers.lifecycle.SWEEP_ASIDE`);
4. yields a :class:`RouteSandbox`, a sandbox whose inner one it can swap: a sandbox lost
   (any provider error) before the command was called, during the file upload say, is
   ended and the run goes on on the next provider, its files uploaded again there. Once
   ``exec`` has been called the command may have started, and the run never moves again
   unless its job is ``retry = "safe"`` (the author's promise that running it twice does no
   harm): then the next provider runs it with what is left of the same deadline (the run
   task's, around upload and command, is never extended).

A provider is tried at most once per run. Every attempt that did not run the command is an
:class:`~relay.providers.contract.Attempt` on the provenance of the sandbox yielded (or, when
the route runs out, in the error's ``details["attempts"]``; when the run is canceled before a
sandbox came, on :attr:`Route.attempts`), and an ``attempt`` event on the bus ("e2b: create
timed out after 10 s; trying daytona").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from relay.providers.contract import Attempt, Sandbox, SandboxSpec
from relay.runs.planning import Plan
from relay.runs.route_sandbox import ATTEMPTS, RouteSandbox, Routing

__all__ = ["ATTEMPTS", "Route", "RouteSandbox", "Routing"]


class Route:
    """A sandbox source over a run's candidates (relay/runs/planning.py: ``Plan.route``)."""

    def __init__(self, plan: Plan, routing: Routing) -> None:
        self.candidates = plan.route
        self.retry_safe = plan.retry_safe
        self.skipped = dict(plan.skipped)
        self.routing = routing
        self.box: RouteSandbox | None = None
        """The run's route sandbox once asked for: its attempts outlive a cancel that came
        before it yielded a sandbox (then nothing else carries them)."""

    @property
    def attempts(self) -> tuple[Attempt, ...]:
        """The attempts the route has made so far (none before it is asked)."""
        return tuple(self.box.attempts) if self.box is not None else ()

    @asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        """The first sandbox a candidate gives (``spec`` names the run; each candidate has
        its own spec); leaving ends whichever sandbox the run holds then."""
        box = self.box = RouteSandbox(
            self.candidates, self.retry_safe, self.routing, spec.run_id, self.skipped
        )
        await box.open_next(None)
        try:
            yield box
        except BaseException as exc:
            await box.close(exc)
            raise
        await box.close(None)
