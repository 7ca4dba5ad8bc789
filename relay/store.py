"""Run state in SQL: SQLAlchemy Core (async), SQLite (WAL) by default, PostgreSQL for replicas.

The store knows nothing of providers. Everything that must hold across replicas
(idempotency, final states written once) is decided here by the database: a unique
index on ``(token, idempotency_key)`` and conditional updates that never overwrite a
final state.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from relay.errors import ConfigError, InvalidRequest

SCHEMA_VERSION = 1
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


class DuplicateKey(Exception):
    """A run with this token and Idempotency-Key exists already."""


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

    @classmethod
    async def open(cls, url: str) -> Store:
        engine = create_async_engine(url, pool_pre_ping=not url.startswith("sqlite"))
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
        """Create the schema, or check that the database's schema is one we understand."""
        async with self.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
            row = (
                await conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version"))
            ).first()
            if row is None:
                await conn.execute(
                    meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION))
                )
            elif int(row[0]) > SCHEMA_VERSION:
                raise ConfigError(
                    f"the database has schema version {row[0]}, newer than this relay's "
                    f"{SCHEMA_VERSION}: upgrade the relay before starting it"
                )

    async def close(self) -> None:
        await self.engine.dispose()

    async def ping(self) -> None:
        async with self.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))

    async def insert_run(self, row: Mapping[str, Any]) -> None:
        try:
            async with self.engine.begin() as conn:
                await conn.execute(runs.insert().values(**row))
        except IntegrityError as exc:
            raise DuplicateKey from exc

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
