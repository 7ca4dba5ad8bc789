"""Run state in SQL: SQLAlchemy Core (async), SQLite (WAL) by default, PostgreSQL for replicas.

The store knows nothing of providers. Everything that must hold across replicas
(idempotency, final states written once) is decided here by the database: a unique
index on ``(token, idempotency_key)`` and conditional updates that never overwrite a
final state.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from relay.errors import ConfigError, InvalidRequest

SCHEMA_VERSION = 4
ACTIVE = ("queued", "starting", "running")
FINAL = ("succeeded", "failed", "timed_out", "canceled", "error", "lost")

metadata = sa.MetaData()

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("job", sa.String(64)),
    sa.Column("provider", sa.String(32), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("idempotency_key", sa.String(255)),
    sa.Column("request_hash", sa.String(64), nullable=False),
    sa.Column("sandbox_id", sa.String(255)),
    sa.Column("exit_code", sa.Integer),
    sa.Column("stdout", sa.Text, nullable=False, default=""),
    sa.Column("stderr", sa.Text, nullable=False, default=""),
    sa.Column("stdout_truncated", sa.Boolean, nullable=False, default=False),
    sa.Column("stderr_truncated", sa.Boolean, nullable=False, default=False),
    sa.Column("timeout_s", sa.Float, nullable=False),
    sa.Column("cpu", sa.Float, nullable=False, default=1.0),
    sa.Column("memory_mb", sa.Integer, nullable=False, default=1024),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("deadline", sa.Float, nullable=False),
    sa.Column("duration_ms", sa.Integer),
    sa.Column("cost_usd", sa.Float, nullable=False, default=0.0),
    sa.Column("reserved_usd", sa.Float, nullable=False, default=0.0, server_default="0"),
    sa.Column("sandbox_s", sa.Float, nullable=False, default=0.0, server_default="0"),
    sa.Column("timings", sa.Text, nullable=False, default="{}"),
    sa.Column("error_code", sa.String(64)),
    sa.Column("error_message", sa.String(500)),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
    sa.Column("callback_url", sa.Text),
    sa.UniqueConstraint("token", "idempotency_key", name="uq_runs_token_key"),
    sa.Index("ix_runs_token_created", "token", "created_at"),
    sa.Index("ix_runs_state", "state"),
)

deliveries = sa.Table(
    "deliveries",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("run_id", sa.String(40), nullable=False),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("attempt_log", sa.Text, nullable=False, default="[]"),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("lease_owner", sa.String(64)),
    sa.Column("lease_until", sa.Float),
    sa.UniqueConstraint("run_id", name="uq_deliveries_run"),
    sa.Index("ix_deliveries_due", "state", "next_attempt_at"),
)
"""Webhook deliveries (relay/webhooks.py): one per finished run that has a callback_url."""

meta = sa.Table(
    "relay_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
)


replicas = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("seen_at", sa.Float, nullable=False),
)
"""Each running relay's heartbeat: a replica not seen for a while has died."""


def _create_tables(*tables: sa.Table) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        metadata.create_all(conn, tables=list(tables))

    return step


def _add_columns(table: sa.Table, *names: str) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        present = {column["name"] for column in sa.inspect(conn).get_columns(table.name)}
        for name in names:
            if name not in present:
                column = table.c[name]
                kind = column.type.compile(dialect=conn.dialect)
                default = f" DEFAULT {column.server_default.arg}" if column.server_default else ""  # type: ignore[attr-defined]
                null = "" if column.nullable else " NOT NULL"
                conn.execute(
                    sa.text(f"ALTER TABLE {table.name} ADD COLUMN {name} {kind}{default}{null}")
                )

    return step


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _create_tables(runs, meta),
    2: _create_tables(replicas),
    3: _add_columns(runs, "reserved_usd", "sandbox_s"),
    4: _create_tables(deliveries),
}
"""Schema version → the step that brings version - 1 to it. Steps only add: an upgrade
never drops or rewrites a run. A relay refuses a database newer than it knows."""
_LOCK_MIGRATE = 7_241_001
_LOCK_SWEEP = 7_241_002
_LOCK_ADMIT = 7_241_003


class DuplicateKey(Exception):
    """A run with this token and Idempotency-Key exists already."""


@dataclass(frozen=True)
class Admission:
    """The limits a new run is admitted under; ``None`` means no limit."""

    token_concurrent: int | None
    global_concurrent: int | None
    runs_per_day: int | None
    usd_per_day: float | None
    day_start: float
    now: float


class LimitReached(Exception):
    """A limit refused the run: which one, its value, and when to try again (seconds)."""

    def __init__(self, kind: str, limit: float, retry_after: float) -> None:
        super().__init__(kind)
        self.kind = kind
        self.limit = limit
        self.retry_after = max(1.0, retry_after)


@dataclass(frozen=True)
class Usage:
    runs: int
    sandbox_s: float
    usd: float
    active: int


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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def _engine_options(url: str) -> dict[str, Any]:
    """Pool settings. A SQLite file gets one connection, so one thread and one writer:
    with several, writers that collide sleep in SQLite's busy handler (1-100 ms a try)
    and each extra connection is another aiosqlite thread. Every store method takes the
    connection for one short transaction and never holds it while taking another.
    The pool's reset-on-return is off for it: each transaction here is ended by its own
    commit or rollback, so the reset would only add a rollback (a thread hop) per use."""
    if not url.startswith("sqlite"):
        return {"pool_pre_ping": True}
    database = sa.engine.make_url(url).database
    if not database or database == ":memory:":
        return {"pool_pre_ping": False}
    return {"pool_pre_ping": False, "pool_size": 1, "max_overflow": 0, "pool_reset_on_return": None}


def encode_cursor(created_at: float, run_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at!r}|{run_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, run_id = raw.split("|", 1)
        return float(created), run_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("cursor is not one this relay gave out") from exc


class Store:
    """Async access to the runs table; one instance per relay process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._admission_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str) -> Store:
        engine = create_async_engine(url, **_engine_options(url))
        if engine.dialect.name == "sqlite":
            sa.event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        store = cls(engine)
        try:
            await store.migrate()
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def migrate(self) -> None:
        """Bring the schema to :data:`SCHEMA_VERSION`, one recorded step at a time."""
        for attempt in range(5):
            try:
                await self._migrate_once()
                return
            except OperationalError:
                # SQLite has no lock to take first: two processes creating the same table
                # at once lose one race; the next attempt sees the other's work.
                if not self.is_sqlite or attempt == 4:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))

    async def _migrate_once(self) -> None:
        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                # Replicas starting together: one migrates, the others wait and then see it.
                await conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({_LOCK_MIGRATE})"))
            await conn.run_sync(_create_tables(meta))
            row = (
                await conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version"))
            ).first()
            has_runs = await conn.run_sync(lambda sync: sa.inspect(sync).has_table("runs"))
            current = int(row[0]) if row else (1 if has_runs else 0)
            if current > SCHEMA_VERSION:
                raise ConfigError(
                    f"the database has schema version {current}, newer than this relay's "
                    f"{SCHEMA_VERSION}: upgrade the relay before starting it"
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                await conn.run_sync(MIGRATIONS[version])
            if row is None:
                await conn.execute(meta.insert().values(key="schema_version", value="0"))
            await conn.execute(
                meta.update()
                .where(meta.c.key == "schema_version")
                .values(value=str(SCHEMA_VERSION))
            )

    async def schema_version(self) -> int:
        async with self.engine.connect() as conn:
            value = await conn.scalar(sa.select(meta.c.value).where(meta.c.key == "schema_version"))
        return int(value or 0)

    @contextlib.asynccontextmanager
    async def sweep_lock(self) -> AsyncIterator[bool]:
        """Held by one replica at a time on PostgreSQL (SQLite has one relay): yields
        whether this caller got it."""
        if self.is_sqlite:
            yield True
            return
        async with self.engine.connect() as conn:
            got = bool(await conn.scalar(sa.text(f"SELECT pg_try_advisory_lock({_LOCK_SWEEP})")))
            try:
                yield got
            finally:
                if got:
                    await conn.execute(sa.text(f"SELECT pg_advisory_unlock({_LOCK_SWEEP})"))
                    await conn.commit()

    async def heartbeat(self, replica_id: str) -> None:
        now = time.time()
        async with self.engine.begin() as conn:
            updated = await conn.execute(
                replicas.update().where(replicas.c.id == replica_id).values(seen_at=now)
            )
            if not updated.rowcount:
                await conn.execute(
                    replicas.insert().values(id=replica_id, started_at=now, seen_at=now)
                )

    async def live_replicas(self, within_s: float) -> set[str]:
        query = sa.select(replicas.c.id).where(replicas.c.seen_at >= time.time() - within_s)
        async with self.engine.connect() as conn:
            return set((await conn.scalars(query)).all())

    async def forget_replica(self, replica_id: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(replicas.delete().where(replicas.c.id == replica_id))

    async def close(self) -> None:
        await self.engine.dispose()

    async def ping(self) -> None:
        async with self.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))

    async def admit_run(self, row: Mapping[str, Any], admission: Admission | None = None) -> None:
        """Insert ``row`` only if every limit allows it (``None``: no limits), atomically
        across replicas.

        Raises :class:`DuplicateKey` for a known Idempotency-Key (checked first, so a retry
        is never refused by a limit its first attempt took) or :class:`LimitReached`.
        """
        if self.is_sqlite:
            async with self._admission_lock:  # SQLite serves one relay process
                await self._admit(row, admission)
        else:
            await self._admit(row, admission)

    async def _admit(self, row: Mapping[str, Any], admission: Admission | None) -> None:
        token = row["token"]
        try:
            async with self.engine.begin() as conn:
                if not self.is_sqlite:
                    await conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({_LOCK_ADMIT})"))
                if row.get("idempotency_key") is not None:
                    known = await conn.scalar(
                        sa.select(runs.c.id).where(
                            runs.c.token == token, runs.c.idempotency_key == row["idempotency_key"]
                        )
                    )
                    if known is not None:
                        raise DuplicateKey
                if admission is not None:
                    await self._check_limits(conn, token, row, admission)
                await conn.execute(runs.insert().values(**row))
        except IntegrityError as exc:
            raise DuplicateKey from exc

    async def _check_limits(
        self, conn: AsyncConnection, token: str, row: Mapping[str, Any], admission: Admission
    ) -> None:
        active = runs.c.state.in_(ACTIVE)
        soonest = sa.func.min(runs.c.deadline)
        if admission.global_concurrent is not None:
            count, first_end = (
                await conn.execute(sa.select(sa.func.count(), soonest).where(active))
            ).one()
            if count >= admission.global_concurrent:
                raise LimitReached(
                    "concurrency", admission.global_concurrent, (first_end or 0) - admission.now
                )
        if admission.token_concurrent is not None:
            count, first_end = (
                await conn.execute(
                    sa.select(sa.func.count(), soonest).where(active, runs.c.token == token)
                )
            ).one()
            if count >= admission.token_concurrent:
                raise LimitReached(
                    "concurrency", admission.token_concurrent, (first_end or 0) - admission.now
                )
        next_day = admission.day_start + 86_400 - admission.now
        today = sa.and_(runs.c.token == token, runs.c.created_at >= admission.day_start)
        if admission.runs_per_day is not None:
            count = await conn.scalar(sa.select(sa.func.count()).where(today))
            if (count or 0) >= admission.runs_per_day:
                raise LimitReached("runs_per_day", admission.runs_per_day, next_day)
        if admission.usd_per_day is not None:
            spent = sa.func.coalesce(
                sa.func.sum(sa.case((active, runs.c.reserved_usd), else_=runs.c.cost_usd)), 0.0
            )
            used = float(await conn.scalar(sa.select(spent).where(today)) or 0.0)
            if used + float(row.get("reserved_usd", 0.0)) > admission.usd_per_day + 1e-12:
                raise LimitReached("usd_per_day", admission.usd_per_day, next_day)

    async def usage(self, token: str, since: float) -> Usage:
        """Runs, sandbox seconds and USD of a token's runs created since ``since``."""
        active = runs.c.state.in_(ACTIVE)
        query = sa.select(
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(runs.c.sandbox_s), 0.0),
            sa.func.coalesce(sa.func.sum(runs.c.cost_usd), 0.0),
            sa.func.coalesce(sa.func.sum(sa.case((active, 1), else_=0)), 0),
        ).where(runs.c.token == token, runs.c.created_at >= since)
        async with self.engine.connect() as conn:
            count, seconds, usd, running = (await conn.execute(query)).one()
        return Usage(int(count), float(seconds), float(usd), int(running))

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(runs).where(runs.c.id == run_id))).first()
        return dict(row._mapping) if row else None

    async def find_by_key(self, token: str, key: str) -> dict[str, Any] | None:
        query = sa.select(runs).where(runs.c.token == token, runs.c.idempotency_key == key)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return dict(row._mapping) if row else None

    async def update_run(self, run_id: str, *, only_if_active: bool = True, **values: Any) -> bool:
        """Update a run; with ``only_if_active`` a final state is never overwritten."""
        if "timings" in values and not isinstance(values["timings"], str):
            values["timings"] = json.dumps(values["timings"])
        query = runs.update().where(runs.c.id == run_id).values(**values)
        if only_if_active:
            query = query.where(runs.c.state.not_in(FINAL))
        async with self.engine.begin() as conn:
            result = await conn.execute(query)
            if result.rowcount and values.get("state") in FINAL:
                await conn.execute(delivery_for_final_run(run_id))
        return bool(result.rowcount)

    async def list_runs(
        self,
        token: str,
        *,
        state: str | None,
        job: str | None,
        limit: int,
        cursor: str | None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        query = sa.select(runs).where(runs.c.token == token)
        if state:
            query = query.where(runs.c.state == state)
        if job:
            query = query.where(runs.c.job == job)
        if cursor:
            created, run_id = decode_cursor(cursor)
            query = query.where(
                sa.or_(
                    runs.c.created_at < created,
                    sa.and_(runs.c.created_at == created, runs.c.id < run_id),
                )
            )
        query = query.order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit + 1)
        async with self.engine.connect() as conn:
            rows = [dict(row._mapping) for row in await conn.execute(query)]
        next_cursor = None
        if len(rows) > limit:
            rows = rows[:limit]
            next_cursor = encode_cursor(rows[-1]["created_at"], rows[-1]["id"])
        return rows, next_cursor

    async def runs_in_states(
        self, states: Iterable[str], *, owner: str | None = None
    ) -> list[dict[str, Any]]:
        query = sa.select(runs).where(runs.c.state.in_(list(states)))
        if owner is not None:
            query = query.where(runs.c.owner == owner)
        async with self.engine.connect() as conn:
            return [dict(row._mapping) for row in await conn.execute(query)]

    async def runs_by_id(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        async with self.engine.connect() as conn:
            rows = await conn.execute(sa.select(runs).where(runs.c.id.in_(list(ids))))
            return {row.id: dict(row._mapping) for row in rows}
