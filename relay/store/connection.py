"""How the relay connects to its database: the URL it accepts, and SQLite's set-up.

``RELAY_DATABASE_URL`` names SQLite (a file, in WAL mode) or PostgreSQL (asyncpg); the
store (relay/store/database.py) opens one of them. A SQLite connection leaves transactions to
SQLAlchemy, journals to a write-ahead log, waits only briefly for a lock on the loop
thread (longer waits are async sleeps: relay/store/sqlite/group_commit.py) and never checkpoints
inside a commit (relay/store/sqlite/wal_checkpointer.py does, on a thread of its own).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.errors import ConfigError


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # The driver's own transaction handling begins a transaction only before a write and
    # never around DDL; switch it off and let SQLAlchemy's "begin" event say BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    if cursor.execute("PRAGMA page_count").fetchone()[0] == 0:
        # A new file, before its first table (the only time this can be set without a
        # VACUUM): the pages of pruned runs can go back to the file system (retention.py).
        cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    # Short: the loop thread waits here; longer waits are async sleeps
    # (relay/store/sqlite/group_commit.py).
    cursor.execute("PRAGMA busy_timeout=20")
    # Checkpoints run on their own thread (relay/store/sqlite/wal_checkpointer.py), not inside our
    # commits.
    cursor.execute("PRAGMA wal_autocheckpoint=0")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    driver = conn.connection.driver_connection
    if not driver.in_transaction:  # type: ignore[union-attr] # a group began it already
        driver.execute("BEGIN")  # type: ignore[union-attr]


def sqlite_engine(url: sa.URL, **options: Any) -> sa.Engine:
    """A SQLite engine whose connections are set up as this module says."""
    engine = sa.create_engine(url, **options)
    sa.event.listen(engine, "connect", _sqlite_connect)
    sa.event.listen(engine, "begin", _sqlite_begin)
    return engine


def database_url(url: str) -> sa.URL:
    """``sqlite:///…`` (``sqlite+aiosqlite`` and ``+pysqlite`` read the same) or
    ``postgresql://…`` (``postgres://`` and ``+asyncpg`` too); anything else is refused."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigError("RELAY_DATABASE_URL is not a database URL") from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+pysqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ConfigError("RELAY_DATABASE_URL must be sqlite:///PATH or postgresql://…")
