"""The relay's tables, and the additive migrations that bring any older database to them.

One schema for both engines (SQLite and PostgreSQL), through SQLAlchemy Core. A migration
step only adds (tables, nullable or defaulted columns): an upgrade never drops or rewrites
a run, and a relay refuses a database newer than it knows.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

SCHEMA_VERSION = 5
ACTIVE = ("queued", "starting", "running")
FINAL = ("succeeded", "failed", "timed_out", "canceled", "error", "lost")

metadata = sa.MetaData()


def state_in(states: tuple[str, ...]) -> tuple[sa.ColumnElement[str], ...]:
    """Constant states as SQL literals: ``runs.c.state.in_(state_in(ACTIVE))`` renders
    once, where bound values in an IN list are rendered again on every execution."""
    return tuple(sa.literal_column(f"'{state}'") for state in states)


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
    sa.Column("error_retry_after_s", sa.Float),  # the provider's retry hint, when it gave one
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
    5: _add_columns(runs, "error_retry_after_s"),
}
"""Schema version → the step that brings version - 1 to it. Steps only add: an upgrade
never drops or rewrites a run. A relay refuses a database newer than it knows."""
_LOCK_MIGRATE = 7_241_001


class NewerSchema(Exception):
    """The database was written by a newer relay (its schema version)."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


def migrate(conn: Connection) -> None:
    """Bring the schema to :data:`SCHEMA_VERSION`, one recorded step at a time, in the
    caller's transaction. Replicas starting together on PostgreSQL: one migrates under an
    advisory lock, the others wait and then find nothing to do."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({_LOCK_MIGRATE})"))
    metadata.create_all(conn, tables=[meta])
    row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).first()
    current = int(row[0]) if row else (1 if sa.inspect(conn).has_table("runs") else 0)
    if current > SCHEMA_VERSION:
        raise NewerSchema(current)
    for version in range(current + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[version](conn)
    if row is None:
        conn.execute(meta.insert().values(key="schema_version", value="0"))
    conn.execute(
        meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
    )
