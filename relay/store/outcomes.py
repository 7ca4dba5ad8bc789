"""How runs ended, per job or per provider, over a window: what the console's jobs page shows.

Read by ``GET /v1/outcomes`` (admin tokens). Every figure is computed by the database over
the runs created in the window, with SQL both engines run alike (window functions:
SQLite 3.25 and later, PostgreSQL): counts per end state, USD, the p50/p95 of the
duration (nearest rank), failures per cause, and the newest failure. What keeps it fast on
a big table: the window is a range of the ``created_at`` index and the caller bounds its
length (relay/http/operator.py), the answer keeps the :data:`MAX_GROUPS` busiest groups, and
it runs aside (on SQLite a worker thread with its own connection, never the event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.run_state import ACTIVE, FAILURES, RunState
from relay.store.database import Store
from relay.store.schema import runs, state_in

MAX_GROUPS = 200
"""The busiest jobs (or providers) a report lists; the rest are left out (``omitted``)."""
PERCENTILES = (50, 95)

Grouping = Literal["job", "provider"]


@dataclass(frozen=True)
class NewestFailure:
    """The newest failed run of a group."""

    run_id: str
    state: str
    created_at: float
    exit_code: int | None
    error_code: str | None
    error_message: str | None


@dataclass(frozen=True)
class GroupOutcome:
    """One job's (``None``: raw-command runs) or one provider's runs over the window."""

    name: str | None
    runs: int
    active: int
    succeeded: int
    failed: int
    """Runs that ended in one of :data:`FAILURES`."""
    canceled: int
    usd: float
    duration_ms: dict[int, int] = field(default_factory=dict)
    """Percentile (50, 95) → milliseconds, over the ended runs that have a duration."""
    causes: dict[str, int] = field(default_factory=dict)
    """Failures per cause: the run's error code, else ``exit N`` (a non-zero exit),
    else its state (``timed_out``)."""
    last_failure: NewestFailure | None = None


@dataclass(frozen=True)
class GroupOutcomes:
    """The groups, busiest first, and how many groups past :data:`MAX_GROUPS` were left out."""

    groups: list[GroupOutcome]
    omitted: int


def _count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[Any]:
    return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)


_FAILURE = runs.c.state.in_(state_in(FAILURES))
_EXITED = sa.and_(runs.c.state == RunState.failed, runs.c.exit_code.is_not(None))
_CAUSE = sa.case(
    (
        _FAILURE,
        sa.func.coalesce(
            runs.c.error_code,
            sa.case(
                (_EXITED, sa.literal("exit ") + sa.cast(runs.c.exit_code, sa.String)),
                else_=runs.c.state,
            ),
        ),
    )
)
"""Why a run failed (NULL: it did not): its error code, else ``exit N``, else its state."""
_LAST = ("id", "state", "created_at", "exit_code", "error_code", "error_message")
"""What a report tells of a group's newest failure."""


class Outcomes:
    """Store queries of how runs ended, across every token (the admin scope's reading)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def report(self, by: Grouping, since: float, until: float) -> GroupOutcomes:
        """Runs created from ``since`` to before ``until``, grouped ``by`` job or provider.

        Each query reads the window alone, through the ``created_at`` index: the state
        index must not find the failures, or a short window would read every failure the
        table holds. The one sort is of the durations (two narrow columns)."""
        key = runs.c[by]
        window = sa.and_(runs.c.created_at >= since, runs.c.created_at < until)
        cause = _CAUSE.label("cause")
        totals = (
            sa.select(
                key,
                cause,
                sa.func.count(),
                _count(runs.c.state.in_(state_in(ACTIVE))),
                _count(runs.c.state == RunState.succeeded),
                _count(runs.c.state == RunState.canceled),
                sa.func.coalesce(sa.func.sum(runs.c.cost_usd), 0.0),
                sa.func.max(runs.c.created_at),
            )
            .where(window)
            .group_by(key, cause)
        )
        ranked = (
            sa.select(
                key.label("name"),
                runs.c.duration_ms,
                # The share of the group's durations at or below this one.
                sa.func.cume_dist()
                .over(partition_by=key, order_by=runs.c.duration_ms)
                .label("share"),
            )
            .where(window, runs.c.duration_ms.is_not(None))
            .subquery()
        )
        # The nearest rank: the smallest duration at or past the p-th percentile.
        durations = sa.select(
            ranked.c.name,
            *(
                sa.func.min(sa.case((ranked.c.share >= p / 100, ranked.c.duration_ms)))
                for p in PERCENTILES
            ),
        ).group_by(ranked.c.name)

        def work(conn: Connection) -> GroupOutcomes:
            rows = list(conn.execute(totals))
            # Each group's newest failure, found by its creation time (from the totals)
            # on the created_at index; the state is looked at in Python, so that no
            # engine is tempted to read every failure through the state index.
            newest = {row[-1] for row in rows if row[1] is not None}
            failures = sa.select(key, *(runs.c[name] for name in _LAST)).where(
                runs.c.created_at.in_(sorted(newest))
            )
            last = list(conn.execute(failures)) if newest else []
            return _assemble(rows, list(conn.execute(durations)), last)

        return await self.store.read_aside(work)


def _assemble(totals: list[Any], durations: list[Any], failures: list[Any]) -> GroupOutcomes:
    """The groups from the queries' rows, busiest first (then by name)."""
    counts: dict[Any, list[Any]] = {}
    causes: dict[Any, dict[str, int]] = {}
    newest_at: dict[Any, float] = {}
    for name, cause, count, active, succeeded, canceled, usd, latest in totals:
        total = counts.setdefault(name, [0, 0, 0, 0, 0, 0.0])
        failed = count if cause is not None else 0
        for position, value in enumerate((count, active, succeeded, failed, canceled, usd)):
            total[position] += value
        if cause is not None:
            causes.setdefault(name, {})[str(cause)] = int(count)
            newest_at[name] = max(latest, newest_at.get(name, latest))
    last: dict[Any, NewestFailure] = {}
    for name, run_id, state, created, exit_code, code, message in failures:
        known = last.get(name)
        # Another group's failure at the same moment is not this one's; of two of the
        # same group at one moment, the greater id (as the listing orders them).
        if state not in FAILURES or created != newest_at.get(name):
            continue
        if known is None or run_id > known.run_id:
            last[name] = NewestFailure(run_id, state, float(created), exit_code, code, message)
    percentiles = {
        name: {p: int(ms) for p, ms in zip(PERCENTILES, values, strict=True) if ms is not None}
        for name, *values in durations
    }
    groups = [
        GroupOutcome(
            name=name,
            runs=int(count),
            active=int(active),
            succeeded=int(succeeded),
            failed=int(failed),
            canceled=int(canceled),
            usd=float(usd),
            duration_ms=percentiles.get(name, {}),
            causes=dict(sorted(causes.get(name, {}).items(), key=lambda i: (-i[1], i[0]))),
            last_failure=last.get(name),
        )
        for name, (count, active, succeeded, failed, canceled, usd) in counts.items()
    ]
    groups.sort(key=lambda group: (-group.runs, group.name or ""))
    return GroupOutcomes(groups[:MAX_GROUPS], max(0, len(groups) - MAX_GROUPS))
