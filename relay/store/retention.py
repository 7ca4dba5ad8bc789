"""Retention: runs older than ``RELAY_RETENTION_DAYS`` go, with their delivery rows.

The running relay prunes every ``RELAY_PRUNE_INTERVAL_S`` (one replica at a time on
PostgreSQL, under an advisory lock); ``relay prune`` does the same once, from the
command line. What is pruned, and what never is:

- a run created before the cutoff whose state is final, its delivery row and its artifacts'
  listing; an active run is never pruned, nor a run whose webhook delivery is still pending;
- then the artifact contents no run names any more, last stored before the cutoff, and the
  chunks of uploads a relay died writing (relay/store/artifacts.py), counted in bytes;
- in batches of :data:`BATCH` runs, one short transaction each, so the writes of live runs
  never wait long behind a prune; on SQLite on a worker thread, never on the event loop;
- ``token_days`` stays what its triggers make it (relay/store/schema.py): each deleted run is
  taken off its day's count, and the days left with no run are deleted. The cutoff is at
  least a day back, so today's counts, which the daily limits read, never change;
- on SQLite the freed pages are given back to the file system (``incremental_vacuum``, in
  steps, on a worker thread: a
  database made by this version has ``auto_vacuum=INCREMENTAL``; an older one is converted
  by ``relay prune``, which runs one full ``VACUUM`` for it). PostgreSQL's autovacuum
  reuses the space of deleted rows by itself.

The live output of a run lives only in memory while it runs (relay/http/run_stream.py), so there
are no event rows to delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles

from relay.run_state import FINAL
from relay.store import artifacts
from relay.store.connection import database_url
from relay.store.database import Store
from relay.store.objects import Objects
from relay.store.schema import deliveries, pooled, runs, state_in, token_days
from relay.store.sqlite.group_commit import BUSY_WAIT_S

log = logging.getLogger("relay.retention")

BATCH = 20
"""Runs deleted per transaction. Each may hold twice RELAY_MAX_OUTPUT_BYTES of output, and
SQLite frees ~100 MiB a second, holding its write lock meanwhile (not the event loop: the
batches run on a worker thread, ``Store.write_aside``)."""
_LOCK_PRUNE = 7_241_004


@dataclass
class Pruned:
    """Rows deleted (or, on a dry run, that would be)."""

    runs: int = 0
    deliveries: int = 0
    pooled: int = 0
    """Ended warm-pool rows (not counted by a dry run)."""
    artifacts: int = 0
    """Artifact contents (distinct blobs) no run names any more."""
    artifact_bytes: int = 0
    """Their bytes: what pruning frees of artifacts."""


class NotIndexed(sa.sql.functions.GenericFunction[str]):
    """A column SQLite must not pick an index for (``+column``): the state index would
    have it read every final run and sort them, where the creation-time index reads only
    the oldest (3 ms a batch of 20 instead of 10, among 2,000 runs). Elsewhere: the column."""

    type = sa.String()
    name = "not_indexed"
    inherit_cache = True


@compiles(NotIndexed)
def _column(element: NotIndexed, compiler: Any, **options: Any) -> str:
    return str(compiler.process(element.clauses, **options))


@compiles(NotIndexed, "sqlite")
def _column_sqlite(element: NotIndexed, compiler: Any, **options: Any) -> str:
    return "+" + str(compiler.process(element.clauses, **options))


def _prunable(before: float) -> sa.ColumnElement[bool]:
    """Final runs created before ``before`` with no webhook delivery still pending."""
    pending = (
        sa.select(deliveries.c.id)
        .where(deliveries.c.run_id == runs.c.id, deliveries.c.state == "pending")
        .exists()
    )
    final = NotIndexed(runs.c.state).in_(state_in(FINAL))
    return sa.and_(runs.c.created_at < before, final, ~pending)


def count(conn: Connection, before: float) -> Pruned:
    """What pruning at ``before`` would delete."""
    run_count = conn.scalar(sa.select(sa.func.count()).where(_prunable(before)))
    ids = sa.select(runs.c.id).where(_prunable(before))
    delivery_count = conn.scalar(sa.select(sa.func.count()).where(deliveries.c.run_id.in_(ids)))
    blobs, size = artifacts.unused_after(conn, before, ids)
    return Pruned(int(run_count or 0), int(delivery_count or 0), 0, blobs, size)


def delete_batch(conn: Connection, before: float, batch: int = BATCH) -> Pruned:
    """Delete up to ``batch`` prunable runs (oldest first) and their delivery rows, and up
    to ``batch`` ended warm-pool rows as old (relay/store/pools.py)."""
    old_pooled = (
        sa.select(pooled.c.id)
        .where(pooled.c.state == "ended", pooled.c.created_at < before)
        .limit(batch)
        .scalar_subquery()
    )
    pooled_gone = int(conn.execute(pooled.delete().where(pooled.c.id.in_(old_pooled))).rowcount)
    ids = list(
        conn.scalars(
            sa.select(runs.c.id).where(_prunable(before)).order_by(runs.c.created_at).limit(batch)
        )
    )
    if not ids:
        return Pruned(pooled=pooled_gone)
    gone = conn.execute(deliveries.delete().where(deliveries.c.run_id.in_(ids))).rowcount
    # The condition again: a run is never deleted unless it is still prunable now.
    deleted_runs = conn.execute(
        runs.delete()
        .where(runs.c.id.in_(ids), _prunable(before))
        .returning(runs.c.id, runs.c.token)
    ).all()
    deleted = len(deleted_runs)
    artifacts.delete_listings(conn, {row.id: row.token for row in deleted_runs})
    # The triggers took each run off its day; a day with no run left is kept by nothing.
    day = int(before // 86_400)
    conn.execute(token_days.delete().where(token_days.c.runs <= 0, token_days.c.day < day))
    return Pruned(int(deleted), int(gone), pooled_gone)


VACUUM_STEP_PAGES = 1024
"""Pages given back per step: each step holds SQLite's write lock for a few ms."""


def give_back(path: str) -> int:
    """On a SQLite file in incremental auto-vacuum mode, give its free pages back to the
    file system, a step at a time (on a worker thread: it takes ~25 µs a page); the pages
    given back. ``executescript`` steps each pragma to its end, where ``execute`` would
    free one page only."""
    freed = 0
    with contextlib.closing(sqlite3.connect(path, timeout=BUSY_WAIT_S)) as connection:
        connection.isolation_level = None
        if connection.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # 2: INCREMENTAL
            return 0
        while free := int(connection.execute("PRAGMA freelist_count").fetchone()[0]):
            step = min(free, VACUUM_STEP_PAGES)
            connection.executescript(f"PRAGMA incremental_vacuum({step})")
            freed += step
    return freed


def size_bytes(conn: Connection) -> int:
    """How large the store is: the SQLite file's pages, or the PostgreSQL database."""
    if conn.dialect.name == "sqlite":
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar() or 0
        page_size = conn.exec_driver_sql("PRAGMA page_size").scalar() or 0
        return int(pages) * int(page_size)
    return int(conn.scalar(sa.text("SELECT pg_database_size(current_database())")) or 0)


def vacuum_if_needed(url: str) -> int | None:
    """A SQLite file made before incremental auto-vacuum: switch it on with one full
    ``VACUUM`` (a rewrite of the file: for ``relay prune``, never the serving relay); the
    new size, or None when nothing was needed."""
    path = database_url(url).database
    if not path or path == ":memory:":
        return None
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as connection:
        if connection.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:  # INCREMENTAL
            return None
        connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
        connection.execute("VACUUM")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        return int(pages) * int(page_size)


def cutoff(retention_days: float, now: float | None = None) -> float:
    """The creation time before which runs are pruned."""
    return (time.time() if now is None else now) - retention_days * 86_400


async def prune(
    store: Store, before: float, *, dry_run: bool = False, objects: Objects | None = None
) -> Pruned:
    """Delete every prunable run created before ``before``, in batches, then give SQLite's
    freed pages back; on a dry run only count them. With ``objects`` (RELAY_ARTIFACTS_URL)
    the objects of the blobs deleted go too, each batch's once its rows are gone (a row is
    never left naming a deleted object), and uploads abandoned there."""
    if dry_run:
        return await store.read_aside(lambda conn: count(conn, before))
    total = Pruned()
    while True:
        done = await store.write_aside(lambda conn: delete_batch(conn, before))
        total.runs += done.runs
        total.deliveries += done.deliveries
        total.pooled += done.pooled
        if done.runs + done.deliveries + done.pooled == 0:
            break
    while True:  # then the contents no run names any more, a batch a transaction
        blobs, size, in_objects = await store.write_aside(
            lambda conn: artifacts.delete_unused_blobs(conn, before, BATCH)
        )
        if in_objects and objects is not None:
            await objects.delete(in_objects)
        total.artifacts += blobs
        total.artifact_bytes += size
        if not blobs:
            break
    await store.write_aside(lambda conn: artifacts.delete_abandoned_uploads(conn, before))
    if objects is not None:
        await objects.delete_uploads(before)
    if (total.runs or total.artifacts) and store.sqlite_path is not None:
        await asyncio.to_thread(give_back, store.sqlite_path)
    return total


class Pruner:
    """The running relay's retention: prunes every ``interval_s`` and keeps the figures
    /metrics shows (rows pruned, the store's size)."""

    def __init__(
        self,
        store: Store,
        *,
        retention_days: float,
        interval_s: float,
        objects: Objects | None = None,
    ) -> None:
        self.store = store
        self.objects = objects
        self.retention_days = retention_days
        self.interval_s = interval_s
        self.pruned_runs = 0
        self.pruned_deliveries = 0
        self.store_bytes = 0

    async def once(self) -> Pruned:
        """One pass, if no other replica is pruning now."""
        done = Pruned()
        async with self.store.advisory_lock(_LOCK_PRUNE) as got:
            if got:
                done = await prune(self.store, cutoff(self.retention_days), objects=self.objects)
        self.pruned_runs += done.runs
        self.pruned_deliveries += done.deliveries
        self.store_bytes = await self.store.read(size_bytes)
        if done.runs:
            log.info("pruned", extra={"runs": done.runs, "deliveries": done.deliveries})
        return done

    async def run_forever(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as exc:
                log.warning("prune failed", extra={"error_class": type(exc).__name__})
            await asyncio.sleep(self.interval_s)
