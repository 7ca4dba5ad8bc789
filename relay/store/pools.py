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

import asyncio
import concurrent.futures
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from relay.store.connection import database_url
from relay.store.database import Store
from relay.store.schema import pooled, runs

_T = TypeVar("_T")

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


SUMMARY_TIMEOUT_S = 3.0
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
    writing anything; None when the store is not there, not reachable within
    :data:`SUMMARY_TIMEOUT_S`, older than warm pools, or holds no pooled row of
    ``provider`` (``relay probe`` then prints its line as before).

    The read runs on a daemon thread of its own, and so do the blocking calls it makes
    (a host name's lookup, a SQLite lock wait): the probe stops waiting at the timeout and
    exits, where a worker thread of asyncio's would hold the exit until a hung DNS server
    or file system let go of it."""
    answer: concurrent.futures.Future[PoolSummary | None] = concurrent.futures.Future()

    def work() -> None:
        if not answer.set_running_or_notify_cancel():
            return
        try:
            answer.set_result(_read_in_thread(url, provider, since))
        except BaseException as exc:  # told to the waiting probe, which says nothing of it
            answer.set_exception(exc)

    threading.Thread(target=work, name="relay-probe-store", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(answer), SUMMARY_TIMEOUT_S)
    except Exception:  # whatever it is, the probe is about the provider, not the store
        return None


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """An event loop's executor whose calls each get a daemon thread, never joined: a
    call still blocked when the probe gives up does not hold the process."""

    def submit(
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def call() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)

        threading.Thread(target=call, daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


def _read_in_thread(url: str, provider: str, since: float) -> PoolSummary | None:
    target = database_url(url)
    if target.get_backend_name() == "sqlite":
        return _read_sqlite(target.database or "", provider, since)

    async def remote() -> PoolSummary | None:
        asyncio.get_running_loop().set_default_executor(_DaemonThreads())
        async with asyncio.timeout(SUMMARY_TIMEOUT_S):
            return await _read_remote(target, provider, since)

    return asyncio.run(remote())


def _read_sqlite(path: str, provider: str, since: float) -> PoolSummary | None:
    if path in ("", ":memory:") or not os.path.isfile(path):
        return None  # ``mode=ro`` creates nothing either; this says why, without an error
    # A WAL database opened read-only creates its -wal and -shm files where they are missing
    # (the last relay to close it removed them) and leaves them behind, owned by whoever
    # ran the probe: a relay of another user could then not open its own store. Missing,
    # no relay has the file open and all of it is in the file: read it as immutable (no
    # lock, nothing created). Present, a relay may be writing: read through them. Anything
    # else (one of the two, a rollback journal) is not a state to read a summary in.
    present = {suffix for suffix in ("-wal", "-shm", "-journal") if os.path.lexists(path + suffix)}
    if present == {"-wal", "-shm"}:
        options = "mode=ro"
    elif not present:
        options = "mode=ro&immutable=1"
    else:
        return None
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?" + options
    engine = sa.create_engine(
        "sqlite+pysqlite://",
        # A lock held elsewhere is waited for well within SUMMARY_TIMEOUT_S, so this thread
        # is done when the probe gives up on it.
        creator=lambda: sqlite3.connect(uri, uri=True, timeout=SUMMARY_TIMEOUT_S / 3),
        poolclass=sa.pool.NullPool,
    )
    try:
        with engine.connect() as conn:
            return _summary(conn, provider, since)
    finally:
        engine.dispose()


async def _read_remote(url: sa.URL, provider: str, since: float) -> PoolSummary | None:
    remote = create_async_engine(url, poolclass=sa.pool.NullPool)
    try:
        async with remote.connect() as conn:
            return await conn.run_sync(_summary, provider, since)
    finally:
        await remote.dispose()
