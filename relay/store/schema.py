"""The relay's tables, and the additive migrations that bring any older database to them.

One schema for both engines (SQLite and PostgreSQL), through SQLAlchemy Core. A migration
step only adds (tables, nullable or defaulted columns): an upgrade never drops or rewrites
a run, and a relay refuses a database newer than it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.run_state import ACTIVE

SCHEMA_VERSION = 13

metadata = sa.MetaData()


def state_in(states: Iterable[str]) -> tuple[sa.ColumnElement[str], ...]:
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
    # Their sizes in UTF-8 bytes, written with them (Store), so a listing reads no output;
    # NULL for a run written without output (or by a relay older than version 7).
    sa.Column("stdout_bytes", sa.Integer),
    sa.Column("stderr_bytes", sa.Integer),
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
    # What was asked, as the console shows it: env names and stdin's size, never their values.
    sa.Column("request", sa.Text),
    # Each attempt of a route that did not run the command, and the one that did, as a JSON
    # list (relay/runs/run_task.py); NULL when the first attempt ran it (the run says all).
    sa.Column("attempts", sa.Text),
    # Its artifacts as the run's JSON lists them (a JSON array, relay/runs/artifacts.py);
    # NULL for a run that declared none. ``run_artifacts`` indexes the same entries.
    sa.Column("artifacts", sa.Text),
    sa.UniqueConstraint("token", "idempotency_key", name="uq_runs_token_key"),
    sa.Index("ix_runs_token_created", "token", "created_at"),
    sa.Index("ix_runs_state", "state"),
    sa.Index("ix_runs_created", "created_at"),
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
"""Webhook deliveries (relay/webhooks/dispatcher.py): one per finished run that has a
callback_url."""

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
    # Its providers' breakers as of the heartbeat, as JSON (relay/runs/breakers.py): what
    # `relay probe` reads of them; the breakers themselves live in the replica's memory.
    sa.Column("breakers", sa.Text),
)
"""Each running relay's heartbeat: a replica not seen for a while has died."""


token_days = sa.Table(
    "token_days",
    metadata,
    sa.Column("token", sa.String(64), primary_key=True),
    sa.Column("day", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("runs", sa.Integer, nullable=False, default=0),
    sa.Column("usd", sa.Float, nullable=False, default=0.0),
)
"""Each token's runs and USD per UTC day (``day``: ``created_at / 86400``, truncated), what
the daily limits are checked against (relay/store/limits.py). ``usd`` counts an active run at
its reservation and an ended one at its cost. Kept by triggers on ``runs`` in the writing
transaction, so every writer keeps it right, on both engines (a run's token and
``created_at`` are never changed)."""


pooled = sa.Table(
    "pooled",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),  # the sandbox's run tag: pool_…
    sa.Column("shape", sa.String(64), nullable=False),
    sa.Column("job", sa.String(64), nullable=False),
    sa.Column("provider", sa.String(32), nullable=False),
    sa.Column("holder", sa.String(64), nullable=False),  # the replica that created it
    sa.Column("state", sa.String(16), nullable=False),  # creating, ready, claimed, ended
    sa.Column("sandbox_id", sa.String(255)),
    sa.Column("run_id", sa.String(40)),
    sa.Column("cpu", sa.Float, nullable=False),
    sa.Column("memory_mb", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),  # claimable until then
    sa.Column("claimed_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("idle_s", sa.Float, nullable=False, default=0.0),
    sa.Column("idle_usd", sa.Float, nullable=False, default=0.0),
    sa.Index("ix_pooled_claim", "holder", "shape", "state"),
    sa.Index("ix_pooled_state", "state"),
    sa.Index("ix_pooled_created", "created_at"),
)
"""Warm pools' sandboxes (relay/runs/pools.py), one row each from before its create to after
its end: which replica holds it, whether a run claimed it, what its idle time cost."""


token_uses = sa.Table(
    "token_uses",
    metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),  # the value's, as the token file
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("last_used_at", sa.Float, nullable=False),
)
"""When each token value was last used to authenticate, written from memory every minute and
at shutdown (relay/store/token_uses.py), never on a request's path: ``relay tokens list``."""


artifact_blobs = sa.Table(
    "artifact_blobs",
    metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),  # of its bytes, in hex
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("chunks", sa.Integer, nullable=False),
    sa.Column("chunk_bytes", sa.Integer, nullable=False),  # every chunk's size but the last
    # When a run last stored it (written, or found already here): retention deletes a blob
    # no run names only once this is older than its cutoff, never one a run is naming now.
    sa.Column("used_at", sa.Float, nullable=False),
    sa.Index("ix_artifact_blobs_used", "used_at"),
)
"""Artifacts' contents, one row per distinct content (relay/store/artifacts.py): a file two
runs kept alike is stored once."""

artifact_chunks = sa.Table(
    "artifact_chunks",
    metadata,
    # Its blob's sha256; while the blob is being written, the upload's own name (up_…).
    sa.Column("blob", sa.String(64), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)
"""A blob's bytes in chunks of its ``chunk_bytes`` (the last shorter): a 16 MiB artifact is
never one row, nor one allocation to write or read."""

run_artifacts = sa.Table(
    "run_artifacts",
    metadata,
    sa.Column("run_id", sa.String(40), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("size", sa.BigInteger, nullable=False, default=0),
    sa.Column("sha256", sa.String(64)),  # NULL: skipped (nothing kept)
    sa.Column("content_type", sa.String(128), nullable=False),
    sa.Column("truncated", sa.Boolean, nullable=False, default=False),
    sa.Column("skipped", sa.String(500)),
    sa.Index("ix_run_artifacts_sha256", "sha256"),
    sa.Index("ix_run_artifacts_name", "run_id", "name"),
)
"""Each run's artifacts in the order collected: the listing the run's JSON shows, and what
keeps a blob alive."""

token_artifacts = sa.Table(
    "token_artifacts",
    metadata,
    sa.Column("token", sa.String(64), primary_key=True),
    sa.Column("bytes", sa.BigInteger, nullable=False, default=0),
)
"""The bytes each token's runs' listings keep (their kept entries' sizes), what
RELAY_ARTIFACTS_MAX_TOKEN_BYTES is checked against with one lookup: added to in the
transaction that writes a listing, taken off in the one that prunes it
(relay/store/artifacts.py)."""


def _steps(*steps: Callable[[Connection], None]) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        for each in steps:
            each(conn)

    return step


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


def _add_columns_of(
    tables: dict[sa.Table, tuple[str, ...]],
) -> Callable[[Connection], None]:
    def step(conn: Connection) -> None:
        for table, names in tables.items():
            _add_columns(table, *names)(conn)

    return step


_ACTIVE_SQL = ", ".join(f"'{state}'" for state in ACTIVE)


def _day(run: str, dialect: str) -> str:
    """The UTC day number of ``run``'s creation, as SQL: what ``day_number`` computes in
    Python (relay/store/limits.py). PostgreSQL's CAST rounds, hence its ``floor``."""
    if dialect == "postgresql":
        return f"CAST(floor({run}.created_at / 86400) AS BIGINT)"
    return f"CAST({run}.created_at / 86400 AS INTEGER)"


def _usd(run: str) -> str:
    """What ``run`` counts against its day's budget, as SQL."""
    return (
        f"(CASE WHEN {run}.state IN ({_ACTIVE_SQL}) "
        f"THEN {run}.reserved_usd ELSE {run}.cost_usd END)"
    )


def _count_runs_per_day(conn: Connection) -> None:
    """Version 6: ``token_days``, the triggers that keep it, and its rows for the runs
    there are. Every statement here is constant text: nothing comes from a request."""
    dialect = conn.dialect.name
    metadata.create_all(conn, tables=[token_days])
    new_day, old_day = _day("NEW", dialect), _day("OLD", dialect)
    add = (
        "INSERT INTO token_days (token, day, runs, usd) "  # noqa: S608
        f"VALUES (NEW.token, {new_day}, 1, {_usd('NEW')}) ON CONFLICT (token, day) "
        "DO UPDATE SET runs = token_days.runs + 1, usd = token_days.usd + excluded.usd"
    )
    change = (
        f"UPDATE token_days SET usd = usd - {_usd('OLD')} + {_usd('NEW')} "  # noqa: S608
        f"WHERE token = NEW.token AND day = {new_day}"
    )
    remove = (
        f"UPDATE token_days SET runs = runs - 1, usd = usd - {_usd('OLD')} "  # noqa: S608
        f"WHERE token = OLD.token AND day = {old_day}"
    )
    differs = {"sqlite": "IS NOT", "postgresql": "IS DISTINCT FROM"}[dialect]
    triggers = {  # name: (event, condition, body)
        "insert": ("INSERT", "", add),
        "update": (
            "UPDATE OF state, reserved_usd, cost_usd",
            f"{_usd('OLD')} {differs} {_usd('NEW')}",
            change,
        ),
        "delete": ("DELETE", "", remove),
    }
    # Triggers first: on PostgreSQL creating one locks out writers to runs until this
    # transaction ends, so no run slips in between them and the rows counted below.
    if dialect == "postgresql":
        conn.exec_driver_sql(
            "CREATE OR REPLACE FUNCTION relay_count_run() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ BEGIN IF TG_OP = 'INSERT' THEN {add}; ELSIF TG_OP = 'UPDATE' THEN "
            f"{change}; ELSE {remove}; END IF; RETURN NULL; END $$"
        )
    for name, (event, condition, body) in triggers.items():
        if dialect == "postgresql":
            when = f" WHEN ({condition})" if condition else ""
            action = "FOR EACH ROW" + when + " EXECUTE FUNCTION relay_count_run()"
        else:
            when = f" WHEN {condition}" if condition else ""
            action = when + f" BEGIN {body}; END"
        conn.exec_driver_sql(f"CREATE TRIGGER runs_counted_{name} AFTER {event} ON runs {action}")
    day = _day("runs", dialect)
    conn.exec_driver_sql(
        "INSERT INTO token_days (token, day, runs, usd) "  # noqa: S608
        f"SELECT token, {day}, count(*), sum({_usd('runs')}) FROM runs GROUP BY token, {day}"
    )


def _bound_listings_and_retention(conn: Connection) -> None:
    """Version 7: the output's sizes beside it (a listing shows them without reading the
    output), filled in for the runs there are; and an index of runs by creation time
    alone, what retention (relay/store/retention.py) deletes by."""
    _add_columns(runs, "stdout_bytes", "stderr_bytes")(conn)
    size = {
        "sqlite": "length(CAST({} AS BLOB))",
        "postgresql": "octet_length({})",
    }[conn.dialect.name]
    conn.exec_driver_sql(
        f"UPDATE runs SET stdout_bytes = {size.format('stdout')}, "  # noqa: S608 - constant
        f"stderr_bytes = {size.format('stderr')}"
    )
    index = next(index for index in runs.indexes if index.name == "ix_runs_created")
    index.create(conn, checkfirst=True)


def _count_token_artifacts(conn: Connection) -> None:
    """Version 13: ``token_artifacts``, with the bytes the listings there are keep."""
    metadata.create_all(conn, tables=[token_artifacts])
    conn.exec_driver_sql(
        "INSERT INTO token_artifacts (token, bytes) "
        "SELECT runs.token, sum(run_artifacts.size) FROM run_artifacts "
        "JOIN runs ON runs.id = run_artifacts.run_id "
        "WHERE run_artifacts.sha256 IS NOT NULL GROUP BY runs.token"
    )


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _create_tables(runs, meta),
    2: _create_tables(replicas),
    3: _add_columns(runs, "reserved_usd", "sandbox_s"),
    4: _create_tables(deliveries),
    5: _add_columns(runs, "error_retry_after_s"),
    6: _count_runs_per_day,
    7: _bound_listings_and_retention,
    8: _add_columns(runs, "request"),
    9: _create_tables(pooled),
    10: _create_tables(token_uses),
    11: _add_columns_of({runs: ("attempts",), replicas: ("breakers",)}),
    12: _steps(
        _create_tables(artifact_blobs, artifact_chunks, run_artifacts),
        _add_columns(runs, "artifacts"),
    ),
    13: _count_token_artifacts,
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
