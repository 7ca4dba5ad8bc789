"""Reads of a store by a command that does not own it (``relay probe``): nothing created,
migrated or written, and never waited on past :data:`QUIET_READ_TIMEOUT_S`.

:func:`read_quietly` runs one read on a daemon thread of its own; what ``relay probe``
reads through it: a provider's warm pools (relay/store/pools.py: ``read_summary``) and its
breakers as the replicas' heartbeats last wrote them (:func:`read_breakers`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sqlite3
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from relay.store.connection import database_url
from relay.store.schema import replicas

_T = TypeVar("_T")

QUIET_READ_TIMEOUT_S = 3.0
"""How long a quiet read is waited for; then the command goes on without it."""


async def read_quietly(url: str, work: Callable[[Connection], _T | None]) -> _T | None:
    """``work`` on a read-only connection to the store at ``url``; None when the store is
    not there, not reachable within :data:`QUIET_READ_TIMEOUT_S`, or ``work`` fails (an
    older schema, say).

    The read runs on a daemon thread of its own, and so do the blocking calls it makes
    (a host name's lookup, a SQLite lock wait): the caller stops waiting at the timeout and
    exits, where a worker thread of asyncio's would hold the exit until a hung DNS server
    or file system let go of it."""
    answer: concurrent.futures.Future[_T | None] = concurrent.futures.Future()

    def read() -> None:
        if not answer.set_running_or_notify_cancel():
            return
        try:
            answer.set_result(_read_in_thread(url, work))
        except BaseException as exc:  # told to the waiting caller, which says nothing of it
            answer.set_exception(exc)

    threading.Thread(target=read, name="relay-quiet-read", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(answer), QUIET_READ_TIMEOUT_S)
    except Exception:  # whatever it is, the caller is about something else than the store
        return None


@dataclass(frozen=True)
class BreakerReading:
    """One provider's breakers on the replicas whose heartbeat is recent."""

    states: dict[str, int]
    """How many replicas hold it in each state (closed, half_open, open)."""
    consecutive_failures: int
    """The most failed creates in a row any of them counts."""


BREAKERS_FRESH_S = 60.0
"""A replica whose last heartbeat is older than this is not read (it may have died)."""


async def read_breakers(url: str, provider: str) -> BreakerReading | None:
    """``provider``'s breakers as each live replica's heartbeat last wrote them; None when
    the store cannot be read quietly or no live replica has written one for it."""
    return await read_quietly(url, lambda conn: _breakers(conn, provider))


def _breakers(conn: Connection, provider: str) -> BreakerReading | None:
    fresh = time.time() - BREAKERS_FRESH_S
    query = sa.select(replicas.c.breakers).where(replicas.c.seen_at >= fresh)
    states: Counter[str] = Counter()
    worst = 0
    for (text,) in conn.execute(query):
        found = json.loads(text or "{}").get(provider)
        if isinstance(found, dict):
            states[str(found.get("state"))] += 1
            worst = max(worst, int(found.get("consecutive_failures") or 0))
    return BreakerReading(dict(states), worst) if states else None


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """An event loop's executor whose calls each get a daemon thread, never joined: a
    call still blocked when the caller gives up does not hold the process."""

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


def _read_in_thread(url: str, work: Callable[[Connection], _T | None]) -> _T | None:
    target = database_url(url)
    if target.get_backend_name() == "sqlite":
        return _read_sqlite(target.database or "", work)

    async def remote() -> _T | None:
        asyncio.get_running_loop().set_default_executor(_DaemonThreads())
        async with asyncio.timeout(QUIET_READ_TIMEOUT_S):
            return await _read_remote(target, work)

    return asyncio.run(remote())


def _read_sqlite(path: str, work: Callable[[Connection], _T | None]) -> _T | None:
    if path in ("", ":memory:") or not os.path.isfile(path):
        return None  # ``mode=ro`` creates nothing either; this says why, without an error
    # A WAL database opened read-only creates its -wal and -shm files where they are missing
    # (the last relay to close it removed them) and leaves them behind, owned by whoever
    # ran the probe: a relay of another user could then not open its own store. Missing,
    # no relay has the file open and all of it is in the file: read it as immutable (no
    # lock, nothing created). Present, a relay may be writing: read through them. Anything
    # else (one of the two, a rollback journal) is not a state to read in.
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
        # A lock held elsewhere is waited for well within QUIET_READ_TIMEOUT_S, so this
        # thread is done when the caller gives up on it.
        creator=lambda: sqlite3.connect(uri, uri=True, timeout=QUIET_READ_TIMEOUT_S / 3),
        poolclass=sa.pool.NullPool,
    )
    try:
        with engine.connect() as conn:
            return work(conn)
    finally:
        engine.dispose()


async def _read_remote(url: sa.URL, work: Callable[[Connection], _T | None]) -> _T | None:
    remote = create_async_engine(url, poolclass=sa.pool.NullPool)
    try:
        async with remote.connect() as conn:
            return await conn.run_sync(work)
    finally:
        await remote.dispose()
