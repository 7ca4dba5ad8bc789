"""Pooled sandbox rows: the store side of warm pools (relay/runs/pools.py).

A row is written before its sandbox is created and ended after it is terminated, so no
pooled sandbox is ever untracked. Every change of state is one conditional UPDATE that
names the state it leaves: a run's claim (``ready`` → ``claimed``), an expiry or a drain
(``ready`` → ``ended``) and the reaper (anything → ``ended``) can race, across replicas
too, and exactly one of them wins. The idle time (created → claimed or ended) and what it
cost are written by the change that ends it.

:func:`read_summary` is ``relay probe``'s read of one provider's pools: it opens the store
read-only and never creates or migrates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.store.database import Store
from relay.store.quiet_reads import QUIET_READ_TIMEOUT_S, read_quietly
from relay.store.schema import pooled, runs

CREATING, READY, CLAIMED, ENDED = "creating", "ready", "claimed", "ended"
WAITING = (CREATING, READY)
"""States a pooled sandbox is in before a run has it (what ``RELAY_POOL_MAX`` counts)."""


@dataclass(frozen=True, kw_only=True)
class PoolRecord:
    """One row of ``pooled``."""

    id: str
    shape: str
    job: str
    provider: str
    holder: str
    state: str
    sandbox_id: str | None = None
    run_id: str | None = None
    cpu: float
    memory_mb: int
    created_at: float
    expires_at: float
    claimed_at: float | None = None
    ended_at: float | None = None
    idle_s: float = 0.0
    idle_usd: float = 0.0


def _record(row: Any) -> PoolRecord:
    return PoolRecord(**row._mapping)


def _idle(now: float, usd_per_s: float) -> dict[str, Any]:
    """The idle time from creation to ``now`` and its cost, as SQL values; never below 0
    (a replica whose clock is behind the creator's may be the one that ends the row)."""
    elapsed = sa.literal(now) - pooled.c.created_at
    seconds = sa.case((elapsed < 0, 0.0), else_=elapsed)
    return {"idle_s": seconds, "idle_usd": seconds * usd_per_s}


CAP_LOCK = 7_241_004
"""PostgreSQL advisory lock held while a replica counts and adds a pooled sandbox."""


class PoolRows:
    """Queries on the ``pooled`` table, through the relay's one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def add(self, record: PoolRecord, cap: int) -> bool:
        """Write the row of a sandbox about to be created, unless ``cap`` pooled sandboxes
        (every replica's) are waiting already: False then. The count and the insert are one
        transaction, under a lock on PostgreSQL, so replicas refilling at once never pass
        ``RELAY_POOL_MAX`` together (SQLite has one writer)."""
        values = asdict(record)
        waiting = sa.select(sa.func.count()).where(pooled.c.state.in_(WAITING))

        def work(conn: Connection) -> bool:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({CAP_LOCK})"))
            if int(conn.scalar(waiting) or 0) >= cap:
                return False
            conn.execute(pooled.insert().values(**values))
            return True

        return await self.store.write(work)

    async def mark_ready(self, pool_id: str, sandbox_id: str) -> bool:
        """The sandbox exists; False when the row was ended meanwhile (by the reaper)."""
        query = (
            pooled.update()
            .where(pooled.c.id == pool_id, pooled.c.state == CREATING)
            .values(state=READY, sandbox_id=sandbox_id)
        )
        return bool(await self.store.write(lambda conn: conn.execute(query).rowcount))

    async def claim(
        self, holder: str, shape: str, run_id: str, now: float, usd_per_s: float
    ) -> PoolRecord | None:
        """Give one of ``holder``'s ready, unexpired sandboxes of ``shape`` to ``run_id``,
        atomically: the UPDATE names ``state = 'ready'``, so of two claims (or a claim and
        an expiry, or the reaper) of one row exactly one wins. None: none to claim."""
        candidates = (
            sa.select(pooled.c.id)
            .where(
                pooled.c.holder == holder,
                pooled.c.shape == shape,
                pooled.c.state == READY,
                pooled.c.expires_at > now,
            )
            .order_by(pooled.c.created_at)
            .limit(1)
        )

        def work(conn: Connection) -> PoolRecord | None:
            # SKIP LOCKED on PostgreSQL (a concurrent claim takes the next row instead of
            # waiting for this one); SQLite writes one transaction at a time anyway.
            locked = candidates.with_for_update(skip_locked=True)
            pool_id = conn.scalar(locked if conn.dialect.name == "postgresql" else candidates)
            if pool_id is None:
                return None
            query = (
                pooled.update()
                .where(pooled.c.id == pool_id, pooled.c.state == READY)
                .values(state=CLAIMED, run_id=run_id, claimed_at=now, **_idle(now, usd_per_s))
                .returning(*pooled.c)
            )
            row = conn.execute(query).first()
            return _record(row) if row is not None else None

        return await self.store.write(work)

    async def end(
        self, pool_id: str, now: float, usd_per_s: float, *, states: Sequence[str] = WAITING
    ) -> bool:
        """End the row if it is in one of ``states``; a row that was waiting records its
        idle time until ``now`` (a claimed one keeps its idle time from the claim). True:
        this caller ended it, and must terminate its sandbox."""
        base = pooled.update().where(pooled.c.id == pool_id, pooled.c.state.in_(list(states)))

        def work(conn: Connection) -> bool:
            waiting = base.where(pooled.c.state.in_(WAITING)).values(
                state=ENDED, ended_at=now, **_idle(now, usd_per_s)
            )
            if conn.execute(waiting).rowcount:
                return True
            return bool(conn.execute(base.values(state=ENDED, ended_at=now)).rowcount)

        return await self.store.write(work)

    async def held(self, holder: str, states: Sequence[str] = WAITING) -> list[PoolRecord]:
        query = sa.select(pooled).where(pooled.c.holder == holder, pooled.c.state.in_(list(states)))
        return await self.store.read(lambda conn: [_record(row) for row in conn.execute(query)])

    async def unended(self) -> list[PoolRecord]:
        """Every row whose sandbox may still exist (the reaper's)."""
        query = sa.select(pooled).where(pooled.c.state != ENDED)
        return await self.store.read(lambda conn: [_record(row) for row in conn.execute(query)])

    async def by_id(self, ids: Sequence[str]) -> dict[str, PoolRecord]:
        if not ids:
            return {}
        query = sa.select(pooled).where(pooled.c.id.in_(list(ids)))
        records = await self.store.read(lambda conn: [_record(row) for row in conn.execute(query)])
        return {record.id: record for record in records}

    async def waiting(self) -> int:
        """Pooled sandboxes creating or ready, on every replica (``RELAY_POOL_MAX``)."""
        query = sa.select(sa.func.count()).where(pooled.c.state.in_(WAITING))
        count: int | None = await self.store.read(lambda conn: conn.scalar(query))
        return int(count or 0)

    async def idle_since(self, since: float, token: str | None = None) -> tuple[float, float]:
        """Idle seconds and their USD of pooled sandboxes created since ``since`` whose
        idle time has ended (claimed or ended): every one, or with ``token`` only those
        that runs of that token claimed."""
        query = sa.select(
            sa.func.coalesce(sa.func.sum(pooled.c.idle_s), 0.0),
            sa.func.coalesce(sa.func.sum(pooled.c.idle_usd), 0.0),
        ).where(pooled.c.created_at >= since)
        if token is not None:
            query = query.join(runs, runs.c.id == pooled.c.run_id).where(runs.c.token == token)
        seconds, usd = await self.store.read(lambda conn: conn.execute(query).one())
        return float(seconds), float(usd)


@dataclass(frozen=True)
class PoolSummary:
    """One provider's warm pools, relay-wide (every replica), as ``relay probe`` shows them."""

    ready: int
    """Ready now, waiting for a run."""
    claimed: int
    """Claimed by a run since ``since``."""
    idle_s: float
    """Idle time of the sandboxes created since ``since`` whose idle time has ended."""
    idle_usd: float


SUMMARY_TIMEOUT_S = QUIET_READ_TIMEOUT_S
"""How long ``relay probe`` waits for the store before it prints its line without it."""


def _summary(conn: Connection, provider: str, since: float) -> PoolSummary | None:
    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)

    def total(column: sa.ColumnElement[float]) -> sa.ColumnElement[float]:
        return sa.func.coalesce(sa.func.sum(sa.case((pooled.c.created_at >= since, column))), 0.0)

    query = sa.select(
        sa.func.count(),
        count(pooled.c.state == READY),
        count(pooled.c.claimed_at >= since),
        total(pooled.c.idle_s),
        total(pooled.c.idle_usd),
    ).where(pooled.c.provider == provider)
    rows, ready, claimed, idle_s, idle_usd = conn.execute(query).one()
    if not rows:
        return None
    return PoolSummary(int(ready), int(claimed), float(idle_s), float(idle_usd))


async def read_summary(url: str, provider: str, since: float) -> PoolSummary | None:
    """``provider``'s pools in the store at ``url``, read without creating, migrating or
    writing anything (:func:`~relay.store.quiet_reads.read_quietly`); None when the store
    is not there, not reachable within :data:`SUMMARY_TIMEOUT_S`, older than warm pools, or
    holds no pooled row of ``provider`` (``relay probe`` then prints its line as before)."""
    return await read_quietly(url, lambda conn: _summary(conn, provider, since))
