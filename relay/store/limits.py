"""Admission limits, decided in the database in the transaction that inserts the run.

Per token: runs at once, runs a day, USD a day (the worst case of active runs counts, the
measured cost of ended ones; both read from one ``token_days`` row, which triggers keep);
per relay: runs at once. ``Store.admit_run`` calls
:func:`check_limits` between the idempotency check and the insert, under an advisory lock
on PostgreSQL, so the limits hold across replicas, and raises :class:`LimitReached`; what
the caller is told of it (the 429) is the run service's (relay/runs/limits.py). Days and
months are UTC (:func:`day_start`, :func:`month_start`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.store.records import RunRecord
from relay.store.schema import ACTIVE, runs, state_in, token_days
from relay.store.sqlite import fast_path


class DuplicateKey(Exception):
    """A run with this token and Idempotency-Key exists already."""


@dataclass(frozen=True)
class Admission:
    """The limits a new run is admitted under; ``None`` means no limit."""

    token_concurrent: int | None
    global_concurrent: int | None
    runs_per_day: int | None
    usd_per_day: float | None
    now: float


class LimitReached(Exception):
    """A limit refused the run: which one, its value, and when to try again (seconds)."""

    def __init__(self, kind: str, limit: float, retry_after: float) -> None:
        super().__init__(kind)
        self.kind = kind
        self.limit = limit
        self.retry_after = max(1.0, retry_after)


_active = runs.c.state.in_(state_in(ACTIVE))
_mine = runs.c.token == sa.bindparam("token")
_ACTIVE_ALL = sa.select(sa.func.count(), sa.func.min(runs.c.deadline)).where(_active)
_ACTIVE_MINE = sa.select(sa.func.count(), sa.func.min(runs.c.deadline)).where(_active, _mine)
# One row, kept by triggers (relay/store/schema.py): the cost does not grow with the day's runs.
_TODAY = sa.select(
    sa.func.coalesce(sa.func.sum(token_days.c.runs), 0),
    sa.func.coalesce(sa.func.sum(token_days.c.usd), 0.0),
).where(token_days.c.token == sa.bindparam("token"), token_days.c.day == sa.bindparam("day"))


def check_limits(conn: Connection, run: RunRecord, admission: Admission) -> None:
    """Raise :class:`LimitReached` if inserting ``run`` would pass a limit."""
    if admission.global_concurrent is not None:
        count, first_end = fast_path.row(conn, _ACTIVE_ALL, {})
        if count >= admission.global_concurrent:
            raise LimitReached(
                "concurrency", admission.global_concurrent, (first_end or 0) - admission.now
            )
    if admission.token_concurrent is not None:
        count, first_end = fast_path.row(conn, _ACTIVE_MINE, {"token": run.token})
        if count >= admission.token_concurrent:
            raise LimitReached(
                "concurrency", admission.token_concurrent, (first_end or 0) - admission.now
            )
    if admission.runs_per_day is None and admission.usd_per_day is None:
        return
    next_day = day_start(admission.now) + 86_400 - admission.now
    today = {"token": run.token, "day": day_number(run.created_at)}
    count, used = fast_path.row(conn, _TODAY, today)
    if admission.runs_per_day is not None and count >= admission.runs_per_day:
        raise LimitReached("runs_per_day", admission.runs_per_day, next_day)
    if (
        admission.usd_per_day is not None
        and float(used) + run.reserved_usd > admission.usd_per_day + 1e-12
    ):
        raise LimitReached("usd_per_day", admission.usd_per_day, next_day)


def day_number(stamp: float) -> int:
    """The UTC day ``stamp`` is in, as the triggers that keep ``token_days`` compute it
    (relay/store/schema.py)."""
    return int(stamp / 86_400)


def day_start(now: float) -> float:
    """Midnight UTC of the day ``now`` is in: daily limits reset there."""
    return float(day_number(now) * 86_400)


def month_start(now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
