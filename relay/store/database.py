"""Run state in SQL: SQLAlchemy Core, SQLite (WAL) by default, PostgreSQL for replicas.

The store knows nothing of providers. Everything that must hold across replicas
(idempotency, limits, final states written once) is decided here by the database: a
unique index on ``(token, idempotency_key)``, limit checks in the inserting transaction
(under an advisory lock on PostgreSQL) and conditional updates that never overwrite a
final state.

How a transaction runs: each store method is one short transaction written as a plain
function of a SQLAlchemy :class:`~sqlalchemy.engine.Connection` (:meth:`Store.write`).

- **SQLite**: the relay holds one connection and calls that function on the event-loop
  thread. A statement on a local WAL file takes tens of microseconds, less than handing
  it to a thread: through aiosqlite each statement was several thread hops and GIL
  hand-offs, which cost more than the rest of a run together (bench/README.md). The
  writes of one turn of the loop share one commit (relay/store/sqlite/group_commit.py), and a lock
  held by another process (``relay reap`` from cron) is waited for with ``asyncio.sleep``, never
  by blocking the loop for long.
- **PostgreSQL**: the same function runs on the asyncpg engine (``run_sync``), which
  awaits the network under it, so every replica shares one code path with SQLite.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Unpack

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles

from relay.errors import ConfigError, InvalidRequest
from relay.run_state import ACTIVE, FINAL
from relay.store.answering import StoreAnswer
from relay.store.connection import database_url, sqlite_engine
from relay.store.limits import Admission, DuplicateKey, Standing, check_limits, moved, placed
from relay.store.records import RunRecord, RunValues
from relay.store.schema import (
    SCHEMA_VERSION,
    NewerSchema,
    deliveries,
    meta,
    migrate,
    replicas,
    runs,
    state_in,
)
from relay.store.sqlite import fast_path
from relay.store.sqlite.group_commit import BUSY_WAIT_S, GroupCommit
from relay.store.sqlite.wal_checkpointer import Checkpointer

__all__ = ["SCHEMA_VERSION", "DuplicateKey", "RunRecord", "Store", "Usage"]

T = TypeVar("T")

WRITE_CHECK_EVERY_S = 3.0
"""How often ``/readyz`` really writes to the store (:meth:`Store.can_write`)."""
WRITE_CHECK_TIMEOUT_S = 2.0
POSTGRES_CONNECT_TIMEOUT_S = 5.0
"""How long a new PostgreSQL connection may take (asyncpg's own default is 60 s)."""
POSTGRES_STATEMENT_TIMEOUT_S = 10.0
"""How long one statement may wait for PostgreSQL's answer once serving (migrations at
start have no bound). A server that stops answering (frozen, a network partition) is then
a ``503 store_unavailable``, not a request held until the caller gives up."""

_LOCK_SWEEP = 7_241_002
_LOCK_ADMIT = 7_241_003

# Statements built once: SQLAlchemy then reuses their compiled form on every call.
_RUN = sa.select(runs).where(runs.c.id == sa.bindparam("run_id"))
_UPDATE = runs.update().where(runs.c.id == sa.bindparam("run_id"))
_UPDATE_ACTIVE = _UPDATE.where(runs.c.state.not_in(state_in(FINAL)))
_FINISH = _UPDATE_ACTIVE.where(runs.c.cancel_requested == sa.false())
_INSERT = runs.insert()
_BY_KEY = sa.select(runs).where(
    runs.c.token == sa.bindparam("token"), runs.c.idempotency_key == sa.bindparam("key")
)


class OctetLength(sa.sql.functions.GenericFunction[int]):
    """The size of a text in bytes: ``octet_length`` (SQLite before 3.43 lacks it)."""

    type = sa.Integer()
    name = "octet_length"
    inherit_cache = True


@compiles(OctetLength, "sqlite")
def _byte_length_sqlite(element: OctetLength, compiler: Any, **options: Any) -> str:
    return f"length(CAST({compiler.process(element.clauses, **options)} AS BLOB))"


MAX_LISTED_REQUEST_CHARS = 4096
"""Longest request a listing carries (the echo of a run's request: a few hundred characters
unless its params are large); a longer one is read through the run alone."""
_OUTPUT = ("stdout", "stderr", "stdout_bytes", "stderr_bytes", "request", "artifacts")
_SUMMARY_COLUMNS = (
    *(column for column in runs.c if column.name not in _OUTPUT),
    # Measured only for a run written without its sizes (by a relay before version 7).
    sa.func.coalesce(runs.c.stdout_bytes, OctetLength(runs.c.stdout)).label("stdout_bytes"),
    sa.func.coalesce(runs.c.stderr_bytes, OctetLength(runs.c.stderr)).label("stderr_bytes"),
    sa.case((sa.func.length(runs.c.request) <= MAX_LISTED_REQUEST_CHARS, runs.c.request)).label(
        "request"
    ),
)
"""What a listing reads of a run: everything but its output, the output's sizes, and its
request when that is short (so a page's memory still follows its ``limit``)."""


def with_sizes(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` and, for each output among them, its size in UTF-8 bytes."""
    if "stdout" not in values and "stderr" not in values:
        return values
    sized = dict(values)
    for stream in ("stdout", "stderr"):
        if stream in values:
            sized[f"{stream}_bytes"] = len((values[stream] or "").encode())
    return sized


@dataclass(frozen=True)
class Usage:
    """A token's runs, sandbox seconds and USD since some moment, and how many are active."""

    runs: int
    sandbox_s: float
    usd: float
    active: int
    pool_idle_s: float = 0.0
    """Warm pools' idle sandbox seconds in the window (of the sandboxes the token's runs
    claimed; an admin token's: the whole relay's)."""
    pool_idle_usd: float = 0.0


def delivery_for_final_run(run_id: str) -> sa.Insert:
    """Insert a pending delivery for this run if it has a callback_url and none yet.

    Executed in the transaction that writes the run's final state, so a crash right
    after that write cannot lose the callback.
    """
    now = time.time()
    exists = sa.select(deliveries.c.id).where(deliveries.c.run_id == run_id).exists()
    source = sa.select(
        sa.literal("dlv_" + secrets.token_hex(12)),
        runs.c.id,
        runs.c.token,
        runs.c.callback_url,
        sa.literal("pending"),
        sa.literal(0),
        sa.literal("[]"),
        sa.literal(now),
        sa.literal(now),
    ).where(runs.c.id == run_id, runs.c.callback_url.is_not(None), ~exists)
    columns = ["id", "run_id", "token", "url", "state", "attempts", "attempt_log"]
    return deliveries.insert().from_select([*columns, "created_at", "next_attempt_at"], source)


STORE_FAILURES: tuple[type[BaseException], ...] = (
    sa.exc.DBAPIError,
    sa.exc.TimeoutError,  # no pool connection in time
    sqlite3.Error,
    ConnectionError,  # PostgreSQL refusing connections (asyncpg's own errors come wrapped)
)
"""What the database or its driver raises when it cannot do the work (down, restarting,
disk full, locked): the caller should retry later. See :func:`is_store_failure`."""


class StoreTimeout(ConnectionError):
    """PostgreSQL did not answer in time (connecting, or a statement)."""


def is_store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` means the store is unavailable (not a constraint the data broke)."""
    return isinstance(exc, STORE_FAILURES) and not isinstance(exc, IntegrityError)


def _postgres_engine(url: sa.URL, statement_timeout_s: float | None) -> AsyncEngine:
    """The asyncpg engine: connecting bounded, and each statement by ``statement_timeout_s``
    (None: unbounded), waiting for a pooled connection no longer than either."""
    connect_args: dict[str, float] = {"timeout": POSTGRES_CONNECT_TIMEOUT_S}
    if statement_timeout_s is not None:
        connect_args["command_timeout"] = statement_timeout_s
    return create_async_engine(
        url,
        pool_pre_ping=True,
        pool_timeout=statement_timeout_s or 30.0,
        connect_args=connect_args,
    )


def encode_cursor(created_at: float, run_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at!r}|{run_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, run_id = raw.split("|", 1)
        if not run_id.isprintable():  # a NUL: PostgreSQL would refuse the query
            raise ValueError(run_id)
        return float(created), run_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("cursor is not one this relay gave out") from exc


def _first(result: sa.CursorResult[Any]) -> RunRecord | None:
    row = result.first()
    return RunRecord.from_row(row._mapping) if row is not None else None


class Store:
    """The relay's one way into its database; one instance per relay process."""

    def __init__(self, *, sqlite: Connection | None = None, engine: AsyncEngine | None) -> None:
        self.commits = GroupCommit(sqlite) if sqlite is not None else None
        self.engine = engine
        self.checkpointer: Checkpointer | None = None
        self._aside: sa.Engine | None = None  # SQLite file: long reads on their own connection
        self._write_checked: tuple[float, bool] | None = None  # (monotonic time, answer)
        self.sqlite_path: str | None = None
        self.answer = StoreAnswer()
        """Whether writes are refused now; who to tell the moment one is taken again."""

    @property
    def is_sqlite(self) -> bool:
        return self.commits is not None

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True) -> Store:
        """Connect, and (unless told not to) bring the schema up to date."""
        parsed = database_url(url)
        if parsed.get_backend_name() == "sqlite":
            loop_engine = sqlite_engine(
                parsed, connect_args={"check_same_thread": False}, poolclass=sa.pool.StaticPool
            )
            store = cls(sqlite=loop_engine.connect(), engine=None)
            if parsed.database and parsed.database != ":memory:":
                store.checkpointer = Checkpointer(parsed.database)
                store.checkpointer.start()
                store._aside = sqlite_engine(parsed, poolclass=sa.pool.NullPool)
                store.sqlite_path = parsed.database
        else:
            # Migrating first: unbounded (a backfill of a large table takes its time).
            bound = None if migrate else POSTGRES_STATEMENT_TIMEOUT_S
            store = cls(engine=_postgres_engine(parsed, bound))
        try:
            if migrate:
                await store.migrate()
                if store.engine is not None:  # serving from now on: statements are bounded
                    await store.engine.dispose()
                    store.engine = _postgres_engine(parsed, POSTGRES_STATEMENT_TIMEOUT_S)
        except BaseException:
            await store.close()
            raise
        return store

    async def write(self, work: Callable[[Connection], T]) -> T:
        """``work`` in one transaction that may write: committed if it returns, rolled back
        if it raises (on SQLite, in the group commit of this turn of the loop). Each
        outcome is told to :attr:`answer`."""
        try:
            result = await self._write(work)
        except Exception as exc:
            if is_store_failure(exc):
                self.answer.failed()
            else:  # the database answered (a limit, a duplicate key): it is back
                self.answer.took()
            raise
        self.answer.took()
        return result

    async def _write(self, work: Callable[[Connection], T]) -> T:
        if self.commits is not None:
            return await self.commits.write(work)
        assert self.engine is not None
        try:
            async with self.engine.begin() as conn:
                return await conn.run_sync(work)
        except TimeoutError as exc:  # asyncpg's own timeouts come unwrapped
            raise StoreTimeout("the database did not answer in time") from exc

    async def read(self, work: Callable[[Connection], T]) -> T:
        """Run a ``work`` that only reads (on SQLite it needs no write lock)."""
        if self.commits is not None:
            return await self.commits.read(work)
        return await self.write(work)

    async def read_aside(self, work: Callable[[Connection], T]) -> T:
        """A long read (a month of a token's runs) in one transaction that must not hold
        the event loop: on a SQLite file it runs on a worker thread with a connection of
        its own (WAL readers never wait for the writer); elsewhere like :meth:`write`."""
        aside = self._aside
        if aside is None:
            return await self.write(work)

        def in_thread() -> T:
            with aside.connect() as conn, conn.begin():
                return work(conn)

        return await asyncio.to_thread(in_thread)

    async def write_aside(self, work: Callable[[Connection], T]) -> T:
        """A long write (pruning old runs) that must not hold the event loop: on a SQLite
        file on a worker thread with a connection of its own, which takes the write lock
        as it begins, waiting for it on that thread; elsewhere like :meth:`write`. The
        loop's writers wait for it in async sleeps (relay/store/sqlite/group_commit.py)."""
        aside = self._aside
        if aside is None:
            return await self.write(work)

        def in_thread() -> T:
            with aside.connect() as conn:
                driver = conn.connection.driver_connection
                assert driver is not None
                driver.execute(f"PRAGMA busy_timeout={int(BUSY_WAIT_S * 1000)}")
                driver.execute("BEGIN IMMEDIATE")  # SQLAlchemy's begin below only records it
                with conn.begin():
                    return work(conn)

        return await asyncio.to_thread(in_thread)

    async def migrate(self) -> None:
        """Bring the schema to :data:`SCHEMA_VERSION` (relay/store/schema.py)."""
        # Two processes migrating at once take turns: on SQLite the write lock is taken as
        # the transaction begins (relay/store/sqlite/group_commit.py), on PostgreSQL under an
        # advisory lock.
        try:
            await self.write(migrate)
        except NewerSchema as exc:
            raise ConfigError(
                f"the database has schema version {exc.version}, newer than this relay's "
                f"{SCHEMA_VERSION}: upgrade the relay before starting it"
            ) from None

    async def schema_version(self) -> int:
        query = sa.select(meta.c.value).where(meta.c.key == "schema_version")
        return int(await self.read(lambda conn: conn.scalar(query)) or 0)

    async def close(self) -> None:
        if self._aside is not None:
            self._aside.dispose()
        if self.commits is not None:
            self.commits.flush()  # first: the checkpoint below can't pass an open write
        if self.checkpointer is not None:
            self.checkpointer.stop()
        if self.commits is not None:
            engine = self.commits.conn.engine
            self.commits.conn.close()
            engine.dispose()
        if self.engine is not None:
            await self.engine.dispose()

    async def ping(self) -> None:
        async with asyncio.timeout(WRITE_CHECK_TIMEOUT_S):  # /readyz answers promptly
            await self.read(lambda conn: conn.execute(sa.text("SELECT 1")))

    async def can_write(self, replica_id: str) -> bool:
        """Whether the store takes a write now (the replica's heartbeat, a one-row
        UPDATE): a database that answers reads but is full or read-only is not ready.
        Asked at most once per :data:`WRITE_CHECK_EVERY_S`; meanwhile the last answer."""
        now = time.monotonic()
        last = self._write_checked
        if last is not None and now - last[0] < WRITE_CHECK_EVERY_S:
            return last[1]
        self._write_checked = (now, last[1] if last is not None else True)  # one at a time
        try:
            async with asyncio.timeout(WRITE_CHECK_TIMEOUT_S):
                await self.heartbeat(replica_id)
            answer = True
        except Exception:
            answer = False
        self._write_checked = (time.monotonic(), answer)
        return answer

    def sweep_lock(self) -> contextlib.AbstractAsyncContextManager[bool]:
        """Held by one replica at a time on PostgreSQL (SQLite has one relay): yields
        whether this caller got it."""
        return self.advisory_lock(_LOCK_SWEEP)

    @contextlib.asynccontextmanager
    async def advisory_lock(self, key: int) -> AsyncIterator[bool]:
        """Lock ``key``, held by one replica at a time on PostgreSQL (SQLite has one
        relay): yields whether this caller got it."""
        if self.engine is None:
            yield True
            return
        async with self.engine.connect() as conn:
            got = bool(await conn.scalar(sa.text(f"SELECT pg_try_advisory_lock({key})")))
            try:
                yield got
            finally:
                if got:
                    await conn.execute(sa.text(f"SELECT pg_advisory_unlock({key})"))
                    await conn.commit()

    # -- replicas ----------------------------------------------------------------------

    async def heartbeat(self, replica_id: str, breakers: str | None = None) -> None:
        """This replica is alive now; ``breakers``, its providers' breakers as JSON
        (relay/runs/breakers.py), is kept with it for ``relay probe``."""

        def work(conn: Connection) -> None:
            now = time.time()
            beat: dict[str, object] = {"seen_at": now}
            if breakers is not None:
                beat["breakers"] = breakers
            query = replicas.update().where(replicas.c.id == replica_id).values(**beat)
            if not conn.execute(query).rowcount:
                conn.execute(replicas.insert().values(id=replica_id, started_at=now, **beat))

        await self.write(work)

    async def live_replicas(self, within_s: float) -> set[str]:
        query = sa.select(replicas.c.id).where(replicas.c.seen_at >= time.time() - within_s)
        return await self.read(lambda conn: set(conn.scalars(query).all()))

    async def replica_beats(self) -> dict[str, float]:
        """Each replica's last heartbeat (Unix seconds), for saying when one is judged dead."""
        query = sa.select(replicas.c.id, replicas.c.seen_at)
        return await self.read(lambda conn: {row.id: row.seen_at for row in conn.execute(query)})

    async def forget_replica(self, replica_id: str) -> None:
        await self.write(
            lambda conn: conn.execute(replicas.delete().where(replicas.c.id == replica_id))
        )

    # -- runs --------------------------------------------------------------------------

    async def admit_run(
        self, run: RunRecord, admission: Admission | None = None
    ) -> Standing | None:
        """Insert ``run`` only if every limit allows it (``None``: no limits), atomically
        across replicas; returns the token's standing before it (for RateLimit headers),
        ``None`` when no limits were weighed.

        Raises :class:`DuplicateKey` for a known Idempotency-Key (checked first, so a retry
        is never refused by a limit its first attempt took) or :class:`LimitReached`.
        """

        def work(conn: Connection) -> Standing | None:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({_LOCK_ADMIT})"))
            key = run.idempotency_key
            if key is not None and conn.execute(_BY_KEY, {"token": run.token, "key": key}).first():
                raise DuplicateKey
            standing = check_limits(conn, run, admission) if admission else None
            provider = placed(conn, run, admission) if admission else None
            columns = run.columns()
            if provider is not None and standing is not None:
                columns["provider"] = provider
                standing = dataclasses.replace(standing, provider=provider)
            try:
                fast_path.write(conn, _INSERT, with_sizes(columns))
            except IntegrityError as exc:  # the unique index: another replica got there first
                raise DuplicateKey from exc
            return standing

        return await self.write(work)

    async def move_run(self, run_id: str, to: str, cap: int | None) -> bool:
        """Count the active run on provider ``to`` (a route moving on), if ``to`` is below
        ``cap``, under the admission's lock: caps hold across replicas
        (relay/store/limits.py)."""

        def work(conn: Connection) -> bool:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({_LOCK_ADMIT})"))
            return moved(conn, run_id, to, cap)

        return await self.write(work)

    async def usage(self, token: str, since: float) -> Usage:
        """Runs, sandbox seconds and USD of a token's runs created since ``since``."""
        active = runs.c.state.in_(state_in(ACTIVE))
        query = sa.select(
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(runs.c.sandbox_s), 0.0),
            sa.func.coalesce(sa.func.sum(runs.c.cost_usd), 0.0),
            sa.func.coalesce(sa.func.sum(sa.case((active, 1), else_=0)), 0),
        ).where(runs.c.token == token, runs.c.created_at >= since)
        count, seconds, usd, running = await self.read_aside(lambda conn: conn.execute(query).one())
        return Usage(int(count), float(seconds), float(usd), int(running))

    async def get_run(self, run_id: str) -> RunRecord | None:
        return await self.read(lambda conn: _first(conn.execute(_RUN, {"run_id": run_id})))

    async def find_by_key(self, token: str, key: str) -> RunRecord | None:
        params = {"token": token, "key": key}
        return await self.read(lambda conn: _first(conn.execute(_BY_KEY, params)))

    async def update_run(
        self, run_id: str, *, only_if_active: bool = True, **values: Unpack[RunValues]
    ) -> bool:
        """Update a run; with ``only_if_active`` a final state is never overwritten. A final
        state writes the run's webhook delivery (if it has a callback) in the same
        transaction."""
        query = _UPDATE_ACTIVE if only_if_active else _UPDATE

        def work(conn: Connection) -> bool:
            changed = bool(fast_path.write(conn, query, {"run_id": run_id, **with_sizes(values)}))
            if changed and values.get("state") in FINAL:
                conn.execute(delivery_for_final_run(run_id))
            return changed

        return await self.write(work)

    async def finish_run(self, run_id: str, values: RunValues, *, callback: bool) -> bool:
        """Write a run's final ``values`` if it is still active and nobody asked to cancel
        it, with its webhook delivery (``callback``) in the same transaction. False: the
        caller must look at the run (final already, or canceled through another replica)."""

        params = {"run_id": run_id, **with_sizes(values)}

        def work(conn: Connection) -> bool:
            if not fast_path.write(conn, _FINISH, params):
                return False
            if callback:
                conn.execute(delivery_for_final_run(run_id))
            return True

        if callback or self.engine is None:
            return await self.write(work)
        # One statement is a transaction of its own: on PostgreSQL it goes as it is, without
        # a BEGIN and a COMMIT of their own (two round trips of a run's 7), and is as
        # durable when it returns.
        return await self.write_alone(lambda conn: bool(fast_path.write(conn, _FINISH, params)))

    async def write_alone(self, work: Callable[[Connection], T]) -> T:
        """``work`` of a single statement, on PostgreSQL in autocommit (the statement is its
        own transaction, committed when it returns); elsewhere like :meth:`write`."""
        if self.engine is None:
            return await self.write(work)
        try:
            async with self.engine.connect() as conn:
                alone = await conn.execution_options(isolation_level="AUTOCOMMIT")
                return await alone.run_sync(work)
        except TimeoutError as exc:  # asyncpg's own timeouts come unwrapped
            raise StoreTimeout("the database did not answer in time") from exc

    async def list_runs(
        self,
        token: str | None,
        *,
        state: str | Sequence[str] | None,
        job: str | None,
        limit: int,
        cursor: str | None,
        provider: str | None = None,
        since: float | None = None,
        until: float | None = None,
        search: str | None = None,
    ) -> tuple[list[RunRecord], str | None]:
        """A page of the token's runs (every token's: ``token=None``), newest first,
        without their output (its sizes only: a page's memory follows ``limit``, not what
        the runs printed) and with their request when it is short, and the cursor of the
        next page (None: this is the last). ``state`` is one state or any of several;
        ``since``/``until`` bound the creation time (from inclusive, to exclusive);
        ``search`` is a run's id, or text in its job's or token's name (any case)."""
        query = sa.select(*_SUMMARY_COLUMNS)
        if token is not None:
            query = query.where(runs.c.token == token)
        if isinstance(state, str):
            query = query.where(runs.c.state == state)
        elif state:
            query = query.where(runs.c.state.in_(list(state)))
        if search:
            text = search.lower()
            query = query.where(
                sa.or_(
                    runs.c.id == search,
                    sa.func.lower(runs.c.job).contains(text, autoescape=True),
                    sa.func.lower(runs.c.token).contains(text, autoescape=True),
                )
            )
        if job:
            query = query.where(runs.c.job == job)
        if provider:
            query = query.where(runs.c.provider == provider)
        if since is not None:
            query = query.where(runs.c.created_at >= since)
        if until is not None:
            query = query.where(runs.c.created_at < until)
        if cursor:
            created, run_id = decode_cursor(cursor)
            query = query.where(
                sa.or_(
                    runs.c.created_at < created,
                    sa.and_(runs.c.created_at == created, runs.c.id < run_id),
                )
            )
        query = query.order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit + 1)

        def work(conn: Connection) -> list[RunRecord]:
            return [RunRecord.from_row(row._mapping) for row in conn.execute(query)]

        # A search may read far back for a page of matches: on SQLite, off the event loop.
        records = await (self.read_aside(work) if search else self.read(work))
        next_cursor = None
        if len(records) > limit:
            records = records[:limit]
            next_cursor = encode_cursor(records[-1].created_at, records[-1].id)
        return records, next_cursor

    async def runs_in_states(
        self, states: Iterable[str], *, owner: str | None = None
    ) -> list[RunRecord]:
        query = sa.select(runs).where(runs.c.state.in_(list(states)))
        if owner is not None:
            query = query.where(runs.c.owner == owner)
        return await self._records(query)

    async def runs_by_id(self, ids: Sequence[str]) -> dict[str, RunRecord]:
        if not ids:
            return {}
        records = await self._records(sa.select(runs).where(runs.c.id.in_(list(ids))))
        return {record.id: record for record in records}

    async def _records(self, query: sa.Select[Any]) -> list[RunRecord]:
        return await self.read(
            lambda conn: [RunRecord.from_row(row._mapping) for row in conn.execute(query)]
        )
