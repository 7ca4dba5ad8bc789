"""Where a run is: its states, which are active and which final, and the moves between them.

The one home of a run's states. It sits in the ground, below everything that names one: the
store counts active runs in SQL (its schema's triggers and queries are built from
:data:`ACTIVE` and :data:`FINAL`; its reports of how runs ended, from :data:`FAILURES`),
the runs write states (each through :func:`transition`,
which checks :data:`TRANSITIONS`), the HTTP layer answers with them, and the handlers may
not import the store. Copies live where this module cannot reach, pinned to it by
tests/test_run_state.py: the standard-library client's final states (relay/client.py) and
the console script's final states and failures (relay/http/console/static/console.js).

Adding a state: a member of :class:`RunState`, its line in :data:`TRANSITIONS`, and the
tuple it belongs to. A new *active* state changes what the store's day-count triggers hold
(relay/store/schema.py): it needs a migration that rebuilds them, and a test fails until one
is written.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol


class RunState(enum.StrEnum):
    """Where a run is. The first three are active (:data:`ACTIVE`), the last six final."""

    queued = "queued"
    starting = "starting"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    timed_out = "timed_out"
    canceled = "canceled"
    error = "error"
    lost = "lost"

    @property
    def final(self) -> bool:
        """Whether the run has ended: its state is written once and never again."""
        return self in FINAL


ACTIVE: tuple[RunState, ...] = (RunState.queued, RunState.starting, RunState.running)
"""Runs not ended yet: they count against concurrency, and against a day's budget at their
reservation."""
FINAL: tuple[RunState, ...] = (
    RunState.succeeded,
    RunState.failed,
    RunState.timed_out,
    RunState.canceled,
    RunState.error,
    RunState.lost,
)
"""Runs that have ended, each with its cost."""
FAILURES: tuple[RunState, ...] = (
    RunState.failed,
    RunState.timed_out,
    RunState.error,
    RunState.lost,
)
"""The end states a job or provider is to blame for: a non-zero exit, its timeout, a
provider or relay fault, a run lost with its relay. ``canceled`` is someone's choice."""

FIRST: frozenset[RunState] = frozenset({RunState.queued, RunState.starting})
"""What a new run may be created as (the relay has no queue: a run starts at once)."""
TRANSITIONS: Mapping[RunState, frozenset[RunState]] = {
    RunState.queued: frozenset(
        {RunState.starting, RunState.canceled, RunState.error, RunState.lost}
    ),
    # Any end: a create that fails (error), a cancel, the reaper (lost); a quick job ends
    # before its `running` state was stored, so the store may see starting → succeeded.
    RunState.starting: frozenset({RunState.running, *FINAL}),
    RunState.running: frozenset(FINAL),
    **{state: frozenset() for state in FINAL},  # a final state is never left
}
"""From each state, where a run may go next."""


class IllegalTransition(ValueError):
    """A move :data:`TRANSITIONS` does not allow: a fault in the relay's code, not a request's."""


class HasState(Protocol):
    """A run as its writer knows it (a :class:`~relay.store.records.RunRecord`)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> RunState: ...


def transition(run: HasState | None, to: RunState) -> RunState:
    """``to``, once :data:`TRANSITIONS` allows ``run`` to move there (``None``: a new run,
    :data:`FIRST`); else :class:`IllegalTransition`. Every write of a state goes through here.

    It checks the writer's own view of the run; across replicas the store's conditional
    updates decide (a final state is never overwritten there either)."""
    allowed = FIRST if run is None else TRANSITIONS[run.state]
    if to not in allowed:
        where = "a new run" if run is None else f"run {run.id} ({run.state})"
        raise IllegalTransition(f"{where} cannot become {to}")
    return to
