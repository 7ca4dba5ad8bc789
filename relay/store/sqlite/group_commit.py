"""Group commit: the SQLite writes of one turn of the event loop share one commit.

The relay writes SQLite on the event-loop thread (relay/store/database.py). Committing a
transaction on a WAL file writes every page it touched to the log: for a run's insert,
the table's page and one page of each index; that was ~40 µs of every write, the largest
part of what the store cost a run. Under load, many runs write in the same turn of the
loop, mostly to the same pages. Here they share one transaction, each write in a
savepoint of its own, and one commit, at the start of the next turn; while each turn
brings the group more writes, the commit waits a turn more, up to :data:`MAX_WAIT_TURNS`
(over HTTP a relay's runs write in turns of their own, a run's two writes a few turns
apart: committing at the next turn alone, the relay committed 2-3 times as often a run
as the floor, whose request writes twice in its own few turns):

- Nobody goes on before their write is committed: each writer waits for the shared
  commit, and if it fails, every writer in the group gets its error.
- A write that raises is rolled back to its savepoint alone; the others stay.
- A read outside a group runs at once in a transaction of its own; a read while a group
  is open reads inside it and waits for its commit too, so it never hands out a write
  that could still be rolled back.
- The group's transaction takes the write lock when it begins (``BEGIN IMMEDIATE``). A
  lock held by another process (``relay reap`` from cron) is waited for in short async
  sleeps, never by blocking the loop, for up to :data:`BUSY_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.engine import Connection, RootTransaction
from sqlalchemy.exc import DBAPIError, OperationalError

T = TypeVar("T")

MAX_WAIT_TURNS = 2
"""Turns of the loop past the first a group's commit may wait while every turn brings it
more writes; the first turn that brings none commits it (at low load, every group)."""

BUSY_WAIT_S = 10.0
"""How long a transaction waits, in short async sleeps, for another process's lock."""


def is_busy(exc: OperationalError) -> bool:
    code = getattr(exc.orig, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(exc.orig)


class _Group:
    def __init__(self, transaction: RootTransaction, committed: asyncio.Future[None]) -> None:
        self.transaction = transaction
        self.committed = committed
        """The group's outcome (its commit, or the error that ended it); nobody awaits it."""
        self.writes = 1
        """Writes (and reads) that joined the group, the one that opened it counted."""
        self.seen = 1
        """:attr:`writes` when the commit last looked."""
        self.turns = 0
        """Turns the commit has waited for more writes."""
        self.waiters: list[asyncio.Future[None]] = []
        """One future per writer waiting, woken once the outcome is known. A writer's own,
        not the shared one: a cancelled writer cancels its future alone (what
        ``asyncio.shield`` did, without its two callbacks and extra turn a write)."""

    def settle(self) -> None:
        """Wake every writer waiting (the outcome is in :attr:`committed`)."""
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()


class GroupCommit:
    """The one SQLite connection's transactions, writes grouped per turn of the loop."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.groups = 0  # commits so far (the tests count them)
        self._driver: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        self._group: _Group | None = None

    async def write(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in the open group (or a new one); return once it is committed."""
        group = self._group
        if group is None:
            group = await self._open()
        else:
            group.writes += 1
        driver = self._driver
        driver.execute("SAVEPOINT work")
        try:
            result = work(self.conn)
        except BaseException as exc:
            if driver.in_transaction:
                driver.execute("ROLLBACK TO work")
                driver.execute("RELEASE work")
            else:  # the error (disk full, I/O) ended the whole transaction: the group's too
                self._end(group, exc)
            raise
        driver.execute("RELEASE work")
        await _committed(group)
        return result

    async def read(self, work: Callable[[Connection], T]) -> T:
        """Run a read-only ``work``: at once in its own transaction, or inside the open
        group (then it waits for the group's commit, as its writers do)."""
        if self._group is not None:
            return await self.write(work)

        def alone() -> T:
            with self.conn.begin():
                return work(self.conn)

        return await _when_unlocked(alone)

    def flush(self) -> None:
        """Commit the open group now (the store closing)."""
        if self._group is not None:
            self._commit(self._group)

    async def _open(self) -> _Group:
        return await _when_unlocked(self._begin)

    def _begin(self) -> _Group:
        if self._group is not None:  # opened by another writer while this one waited
            self._group.writes += 1
            return self._group
        try:
            # The driver is told directly; SQLAlchemy's begin (relay/store/database.py) sees a
            # transaction already open and only records it.
            self._driver.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise DBAPIError.instance("BEGIN IMMEDIATE", (), exc, sqlite3.Error) from exc
        loop = asyncio.get_running_loop()
        group = _Group(self.conn.begin(), loop.create_future())
        self._group = group
        loop.call_soon(self._due, group)
        return group

    def _due(self, group: _Group) -> None:
        """Commit the group, unless the turn that just ran brought it more writes and it
        may wait a turn more (:data:`MAX_WAIT_TURNS`): more are likely in the next."""
        if self._group is not group:
            return  # already ended
        if group.writes > group.seen and group.turns < MAX_WAIT_TURNS:
            group.seen = group.writes
            group.turns += 1
            group.committed.get_loop().call_soon(self._due, group)
            return
        self._commit(group)

    def _commit(self, group: _Group) -> None:
        if self._group is not group:
            return  # already ended
        try:
            group.transaction.commit()
        except Exception as exc:
            self._end(group, exc)
            return
        self._group = None
        self.groups += 1
        group.committed.set_result(None)
        group.settle()

    def _end(self, group: _Group, error: BaseException) -> None:
        """Fail every write of the group with ``error``; roll back what is left of it."""
        self._group = None
        try:
            group.transaction.rollback()
            if self._driver.in_transaction:  # a refused COMMIT leaves it open
                self._driver.rollback()
        except Exception:  # noqa: S110 - the writers get the first error, which says more
            pass
        if not group.committed.done():
            group.committed.set_exception(error)
            group.committed.exception()  # retrieved: writers that saw their own error won't
        group.settle()


async def _when_unlocked(attempt: Callable[[], T]) -> T:
    """``attempt()``, tried again in short async sleeps while another process holds the
    database's lock, never blocking the loop, for up to :data:`BUSY_WAIT_S`."""
    delay, give_up = 0.005, time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            return attempt()
        except OperationalError as exc:
            if not is_busy(exc) or time.monotonic() > give_up:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


async def _committed(group: _Group) -> None:
    """Wait for the group's commit even if cancelled meanwhile (it is one turn of the
    loop away): a caller that wrote must learn that it was committed, so it goes on to
    do what it wrote down (start the run's task). A cancellation is delivered again at
    its next await."""
    committed = group.committed
    cancelled = False
    while not committed.done():
        waiter = committed.get_loop().create_future()
        group.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # the count stays as the canceller left it
            task.cancel()
    committed.result()
