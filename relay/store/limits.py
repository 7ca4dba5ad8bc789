"""Admission limits, decided in the database in the transaction that inserts the run.

Per token: runs at once, runs a day, USD a day (the worst case of active runs counts, the
measured cost of ended ones; both read from one ``token_days`` row, which triggers keep);
per relay: runs at once, and a token without a limit of runs at once of its own holds at
most its fair share of them (``token_share``, relay/runs/limits.py says why). A run the
admitting replica knows ended (``Admission.settled``: its final write has not landed yet,
the store down a moment ago) counts as ended: not at once, and at its cost, not its
reservation, so its slot is free the moment its outcome is known.
``Store.admit_run`` calls :func:`check_limits` between the idempotency check and the
insert, under an advisory lock on PostgreSQL, so the limits hold across replicas, and
raises :class:`LimitReached`; what the caller is told of it (the 429) is the run service's
(relay/runs/limits.py). Days and months are UTC (:func:`day_start`, :func:`month_start`).

Per provider: runs at once (``RELAY_<NAME>_MAX_CONCURRENT``). A run is counted on the
provider its row names (``runs.provider``): :func:`placed` puts a new run on the first
provider of its ranked route with room, in the same transaction and under the same lock;
:func:`moved` moves a running route's count to the next provider with a conditional update.
A route with no capped provider reads nothing more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.run_state import ACTIVE
from relay.store.records import RunRecord
from relay.store.schema import runs, state_in, token_days
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
    token_share: int | None = None
    """Runs at once of a token with no ``token_concurrent``: its share of the relay's."""
    settled: Mapping[str, float] = field(default_factory=dict)
    """Runs the admitting replica knows ended, with their cost, though the store still
    counts them active (their final write not landed yet): counted as ended."""
    caps: tuple[tuple[str, int | None], ...] = ()
    """The run's route in the order tried, each provider with its runs-at-once cap (None:
    none); empty when no provider of the route has one (nothing is counted)."""


@dataclass(frozen=True)
class Standing:
    """What the token had used when a run was weighed, before that run (``None``: not read,
    its limit being unset). ``frees_in`` is the seconds until the soonest of the token's
    running runs is expected to end (see :func:`_frees_in`), read when at its limit."""

    active: int | None = None
    frees_in: float | None = None
    runs_today: int | None = None
    usd_today: float | None = None
    provider: str | None = None
    """The provider of its route the run was placed on under per-provider caps (None: no
    caps were weighed, the route's first)."""


class LimitReached(Exception):
    """A limit refused the run: which one, its value, when to try again (seconds), and the
    token's standing at that moment."""

    def __init__(
        self,
        kind: str,
        limit: float,
        retry_after: float,
        standing: Standing | None = None,
        full: tuple[tuple[str, int], ...] = (),
    ) -> None:
        super().__init__(kind)
        self.kind = kind
        self.limit = limit
        self.retry_after = max(1.0, retry_after)
        self.standing = standing or Standing()
        self.full = full
        """Each provider at its cap and the cap (``provider_concurrency``)."""


_active = runs.c.state.in_(state_in(ACTIVE))
_mine = runs.c.token == sa.bindparam("token")
_ACTIVE_ALL = sa.select(sa.func.count()).where(_active)
_ACTIVE_MINE = sa.select(sa.func.count()).where(_active, _mine)
# One row, kept by triggers (relay/store/schema.py): the cost does not grow with the day's runs.
_TODAY = sa.select(
    sa.func.coalesce(sa.func.sum(token_days.c.runs), 0),
    sa.func.coalesce(sa.func.sum(token_days.c.usd), 0.0),
).where(token_days.c.token == sa.bindparam("token"), token_days.c.day == sa.bindparam("day"))


@dataclass(frozen=True)
class _Settled:
    """What the store counts of the settled runs still active in it: runs in all, the
    token's, and how much more than their cost their reservations count in its day."""

    everyone: int = 0
    mine: int = 0
    usd_over: float = 0.0
    on: Mapping[str, int] = field(default_factory=dict)
    """Of them, how many each provider's row names (what its cap counts)."""


_SETTLED = sa.select(
    runs.c.id, runs.c.token, runs.c.provider, runs.c.created_at, runs.c.reserved_usd
).where(_active, runs.c.id.in_(sa.bindparam("ids", expanding=True)))


def _settled(conn: Connection, run: RunRecord, admission: Admission) -> _Settled:
    """Read only when the replica has settled runs (after a store outage): one query."""
    if not admission.settled:
        return _Settled()
    rows = conn.execute(_SETTLED, {"ids": list(admission.settled)}).all()
    mine = [row for row in rows if row.token == run.token]
    today = day_number(run.created_at)
    over = sum(
        row.reserved_usd - admission.settled[row.id]
        for row in mine
        if day_number(row.created_at) == today
    )
    return _Settled(len(rows), len(mine), over, Counter(row.provider for row in rows))


def check_limits(conn: Connection, run: RunRecord, admission: Admission) -> Standing:
    """Raise :class:`LimitReached` if inserting ``run`` would pass a limit; else the
    token's standing before ``run`` (for the RateLimit headers of the answer)."""
    settled = _settled(conn, run, admission)
    everyone: int | None = None
    if admission.global_concurrent is not None:
        (everyone,) = fast_path.row(conn, _ACTIVE_ALL, {})
        everyone -= settled.everyone
        if everyone >= admission.global_concurrent:
            frees_in = _frees_in(conn, None, admission.now)
            raise LimitReached("concurrency", admission.global_concurrent, frees_in)
    share = admission.token_share if admission.token_concurrent is None else None
    # Fewer runs in all than the share: this token cannot be at it (no second count).
    if share is not None and (everyone is None or everyone >= share):
        (count,) = fast_path.row(conn, _ACTIVE_MINE, {"token": run.token})
        count -= settled.mine
        if count >= share:
            raise LimitReached("fair_share", share, _frees_in(conn, run.token, admission.now))
    standing = Standing()
    if admission.token_concurrent is not None:
        (count,) = fast_path.row(conn, _ACTIVE_MINE, {"token": run.token})
        count -= settled.mine
        standing = Standing(active=count)
        if count >= admission.token_concurrent:
            frees_in = _frees_in(conn, run.token, admission.now)
            daily = _today(conn, run, admission, settled)
            standing = Standing(count, frees_in, *daily)
            raise LimitReached("concurrency", admission.token_concurrent, frees_in, standing)
    if admission.runs_per_day is None and admission.usd_per_day is None:
        return standing
    next_day = day_start(admission.now) + 86_400 - admission.now
    runs_today, used = _today(conn, run, admission, settled)
    standing = Standing(standing.active, None, runs_today, used)
    if admission.runs_per_day is not None and (runs_today or 0) >= admission.runs_per_day:
        raise LimitReached("runs_per_day", admission.runs_per_day, next_day, standing)
    if (
        admission.usd_per_day is not None
        and (used or 0.0) + run.reserved_usd > admission.usd_per_day + 1e-12
    ):
        raise LimitReached("usd_per_day", admission.usd_per_day, next_day, standing)
    return standing


_ON_PROVIDER = sa.select(sa.func.count()).where(
    _active, runs.c.provider == sa.bindparam("provider")
)


def placed(conn: Connection, run: RunRecord, admission: Admission) -> str | None:
    """The first provider of the run's route (``admission.caps``) with room for one more
    run, counting in the store (a provider with no cap always has room, without a read);
    None when no provider of the route is capped. Raises :class:`LimitReached`
    (``provider_concurrency``) naming every provider full when none has room."""
    if not admission.caps:
        return None
    full: list[tuple[str, int]] = []
    settled = _settled(conn, run, admission)
    for provider, cap in admission.caps:
        if cap is None:
            return provider
        (count,) = fast_path.row(conn, _ON_PROVIDER, {"provider": provider})
        count -= settled.on.get(provider, 0)
        if count < cap:
            return provider
        full.append((provider, cap))
    frees_in = _frees_in(conn, None, admission.now)
    raise LimitReached("provider_concurrency", full[0][1], frees_in, full=tuple(full))


_MOVE = (
    runs.update()
    .where(runs.c.id == sa.bindparam("run_id"), _active)
    .values(provider=sa.bindparam("to"))
)


def moved(conn: Connection, run_id: str, to: str, cap: int | None) -> bool:
    """Count the active run ``run_id`` on provider ``to`` from now on, if ``to`` has room
    (``cap``; None: no cap). False when it is full (or the run has ended)."""
    if cap is not None:
        (count,) = conn.execute(_ON_PROVIDER, {"provider": to}).one()
        if count >= cap:
            return False
    return bool(conn.execute(_MOVE, {"run_id": run_id, "to": to}).rowcount)


def _today(
    conn: Connection, run: RunRecord, admission: Admission, settled: _Settled
) -> tuple[int | None, float | None]:
    """The token's runs and USD of the day ``run`` is in (``None``: no daily limit)."""
    if admission.runs_per_day is None and admission.usd_per_day is None:
        return None, None
    today = {"token": run.token, "day": day_number(run.created_at)}
    count, used = fast_path.row(conn, _TODAY, today)
    return int(count), float(used) - settled.usd_over


RECENT_RUNS = 50
"""How many of the latest runs :func:`_frees_in` learns durations from (a bounded read)."""


def _frees_in(conn: Connection, token: str | None, now: float) -> float:
    """Seconds until the soonest running run (the token's, or any with ``None``) is
    expected to end: its start plus the longest time its job took in the latest
    :data:`RECENT_RUNS` ended runs, at most its deadline; a job with no such run is
    expected at its deadline. A run past its expected end may end any moment: 1 s.

    Its deadline alone (the create timeout plus the job's timeout) would tell the caller of
    a 3 s job to come back in 90 s. Read only when refusing, from a bounded index scan."""
    mine = (runs.c.token == token,) if token is not None else ()
    recent = (
        sa.select(runs.c.job, runs.c.created_at, runs.c.ended_at)
        .where(*mine)
        .order_by(runs.c.created_at.desc())
        .limit(RECENT_RUNS)
    )
    took: dict[str | None, float] = {}
    for job, created_at, ended_at in conn.execute(recent):
        if ended_at is not None:
            took[job] = max(took.get(job, 0.0), ended_at - created_at)
    active = sa.select(runs.c.job, runs.c.created_at, runs.c.deadline).where(_active, *mine)
    ends = [
        min(deadline, created_at + took[job]) if job in took else deadline
        for job, created_at, deadline in conn.execute(active)
    ]
    if not ends:
        return 1.0
    return max(1.0, float(min(ends)) - now)


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
