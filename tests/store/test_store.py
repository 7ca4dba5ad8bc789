"""The store on a real SQLite file and a real PostgreSQL: idempotency decided in the
database, final states kept, versioned migrations that never lose a run."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from relay.errors import ConfigError
from relay.run_state import ACTIVE, RunState
from relay.store import database
from relay.store.connection import database_url
from relay.store.database import SCHEMA_VERSION, DuplicateKey, Store, is_store_failure
from relay.store.limits import Admission, LimitReached
from relay.store.records import RunRecord
from relay.store.schema import meta, metadata, runs, token_days
from testing.postgres import own_postgres


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    opened = await Store.open(database_url)
    yield opened
    await opened.close()


def row(run_id: str, key: str | None = None, **values: Any) -> RunRecord:
    now = time.time()
    return RunRecord(**{
        "id": run_id, "token": "t", "job": "echo", "provider": "local", "state": "queued",
        "idempotency_key": key, "request_hash": "h", "timeout_s": 5.0, "created_at": now,
        "deadline": now + 5, "owner": "me", "stdout": "", "stderr": "", "timings": "{}",
    } | values)  # fmt: skip


async def test_survives_reopen(database_url: str) -> None:
    first = await Store.open(database_url)
    await first.admit_run(row("run_a", stdout="x" * 100_000))
    await first.close()
    second = await Store.open(database_url)
    again = await second.get_run("run_a")
    assert again is not None and again.state == "queued" and len(again.stdout) == 100_000
    assert await second.schema_version() == SCHEMA_VERSION
    await second.close()


async def test_sqlite_uses_wal(tmp_path: Any) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    mode = await store.write(lambda conn: conn.scalar(sa.text("PRAGMA journal_mode")))
    assert mode == "wal"
    await store.close()


async def test_the_aiosqlite_url_of_earlier_versions_still_opens(tmp_path: Any) -> None:
    first = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    await first.admit_run(row("run_kept"))
    await first.close()
    again = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'relay.db'}")
    assert (await again.get_run("run_kept")) is not None
    await again.close()


async def test_a_database_url_of_another_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="RELAY_DATABASE_URL"):
        await Store.open("mysql://db/relay")


async def test_one_run_per_token_and_key_under_a_race(store: Store) -> None:
    results = await asyncio.gather(
        *(store.admit_run(row(f"run_{i}", key="same")) for i in range(10)),
        return_exceptions=True,
    )
    assert sum(r is None for r in results) == 1
    assert all(isinstance(r, DuplicateKey) for r in results if r is not None)
    await store.admit_run(row("run_other_token", key="same", token="u"))
    await store.admit_run(row("run_no_key_1"))
    await store.admit_run(row("run_no_key_2"))


async def test_a_final_state_is_never_overwritten(store: Store) -> None:
    await store.admit_run(row("run_f"))
    assert await store.update_run("run_f", state="succeeded")
    assert not await store.update_run("run_f", state="lost")
    assert (await store.get_run("run_f")).state == "succeeded"  # type: ignore[index]


async def test_listing_pages_in_order(store: Store) -> None:
    for i in range(5):
        await store.admit_run(row(f"run_{i}", created_at=1000.0 + (i // 2)))
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = await store.list_runs("t", state=None, job=None, limit=2, cursor=cursor)
        seen += [r.id for r in page]
        if cursor is None:
            break
    assert seen == ["run_4", "run_3", "run_2", "run_1", "run_0"]


async def test_heartbeats_tell_live_replicas(store: Store) -> None:
    await store.heartbeat("a")
    await store.heartbeat("a")
    assert await store.live_replicas(10) == {"a"}
    await store.forget_replica("a")
    assert await store.live_replicas(10) == set()


async def test_sweep_lock_is_exclusive(database_url: str) -> None:
    first, second = await Store.open(database_url), await Store.open(database_url)
    try:
        async with first.sweep_lock() as got_first, second.sweep_lock() as got_second:
            assert got_first
            assert got_second == first.is_sqlite  # SQLite has a single relay
        async with second.sweep_lock() as again:
            assert again
    finally:
        await first.close()
        await second.close()


async def test_a_newer_schema_refuses_to_start(database_url: str) -> None:
    store = await Store.open(database_url)
    await store.write(
        lambda conn: conn.execute(meta.update().values(value=str(SCHEMA_VERSION + 1)))
    )
    await store.close()
    with pytest.raises(ConfigError, match="newer"):
        await Store.open(database_url)


async def test_upgrading_from_version_1_keeps_every_run(database_url: str) -> None:
    def version_1(conn: sa.Connection) -> None:  # the schema as version 1 of the relay made it
        metadata.create_all(conn, tables=[runs, meta])
        conn.execute(meta.insert().values(key="schema_version", value="1"))
        conn.execute(runs.insert().values(**row("run_old", state="succeeded").columns()))

    old = await Store.open(database_url, migrate=False)
    await old.write(version_1)
    await old.close()
    store = await Store.open(database_url)
    try:
        assert await store.schema_version() == SCHEMA_VERSION
        assert (await store.get_run("run_old")).state == "succeeded"  # type: ignore[index]
        await store.heartbeat("new-replica")
    finally:
        await store.close()


async def test_upgrading_from_version_4_adds_the_retry_hint_and_keeps_every_run(
    database_url: str,
) -> None:
    def version_4(conn: sa.Connection) -> None:  # today's tables, less what version 5 added
        metadata.create_all(conn)
        conn.execute(sa.text("ALTER TABLE runs DROP COLUMN error_retry_after_s"))
        conn.execute(meta.insert().values(key="schema_version", value="4"))
        old = row("run_old", state="error", error_code="x").columns()
        old.pop("error_retry_after_s", None)  # not a column yet
        conn.execute(runs.insert().values(**old))

    def columns(conn: sa.Connection) -> set[str]:
        return {column["name"] for column in sa.inspect(conn).get_columns("runs")}

    old = await Store.open(database_url, migrate=False)
    try:
        await old.write(version_4)
        assert "error_retry_after_s" not in await old.write(columns)
    finally:
        await old.close()
    store = await Store.open(database_url)
    try:
        assert await store.schema_version() == SCHEMA_VERSION
        assert "error_retry_after_s" in await store.write(columns)
        kept = await store.get_run("run_old")
        assert kept is not None
        assert (kept.error_code, kept.error_retry_after_s) == ("x", None)
        await store.admit_run(row("run_new"))
        assert await store.finish_run(
            "run_new", {"state": RunState.error, "error_retry_after_s": 7.0}, callback=False
        )
        assert (await store.get_run("run_new")).error_retry_after_s == 7.0  # type: ignore[index]
    finally:
        await store.close()


async def test_replicas_migrating_at_once(database_url: str) -> None:
    stores = await asyncio.gather(*(Store.open(database_url) for _ in range(3)))
    try:
        assert {await s.schema_version() for s in stores} == {SCHEMA_VERSION}
    finally:
        for s in stores:
            await s.close()


async def test_columns_left_out_get_their_defaults_and_any_columns_can_be_set(
    store: Store,
) -> None:
    # The hot statements are compiled once per set of parameter names
    # (relay/store/sqlite/fast_path.py): a row with only the required columns, then updates naming
    # different columns.
    now = time.time()
    await store.admit_run(
        RunRecord(id="run_min", token="t", provider="local", state="starting",
         request_hash="h", timeout_s=5.0, created_at=now, deadline=now + 5, owner="me")
    )  # fmt: skip
    first = await store.get_run("run_min")
    assert first is not None
    assert (first.stdout, first.stdout_truncated, first.cancel_requested) == (
        "",
        False,
        False,
    )
    assert (first.cost_usd, first.reserved_usd, first.timings) == (0.0, 0.0, "{}")
    assert await store.update_run("run_min", state="running", sandbox_id="sb-1")
    assert await store.update_run("run_min", cancel_requested=True)
    assert not await store.finish_run("run_min", {"state": RunState.succeeded}, callback=False)
    assert await store.update_run("run_min", state="canceled", stderr_truncated=True)
    final = await store.get_run("run_min")
    assert final is not None
    assert (final.state, final.sandbox_id, final.stderr_truncated) == (
        "canceled",
        "sb-1",
        True,
    )


async def test_the_wal_is_checkpointed_off_the_loop_and_truncated_at_close(
    tmp_path: Any,
) -> None:
    path = tmp_path / "relay.db"
    store = await Store.open(f"sqlite:///{path}")
    assert store.checkpointer is not None
    store.checkpointer.every_s = 0.05
    for i in range(300):
        await store.admit_run(row(f"run_{i}", stdout="x" * 2000))
    wal = path.with_name("relay.db-wal")
    assert wal.stat().st_size > 500_000
    # Commits on the loop never checkpoint: that is the thread's job.
    assert await store.write(lambda conn: conn.scalar(sa.text("PRAGMA wal_autocheckpoint"))) == 0
    deadline = time.monotonic() + 5
    while store.checkpointer.done == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert store.checkpointer.done > 0
    await store.close()
    assert not wal.exists() or wal.stat().st_size == 0
    again = await Store.open(f"sqlite:///{path}")
    assert len(await again.runs_in_states(["queued"])) == 300
    await again.close()


async def test_a_column_that_does_not_exist_is_an_error_not_a_silent_no_op(store: Store) -> None:
    await store.admit_run(row("run_typo"))
    with pytest.raises(sa.exc.SQLAlchemyError):
        await store.update_run("run_typo", state="running", sandbox_idd="sb-1")  # type: ignore[call-arg]
    again = await store.get_run("run_typo")
    assert again is not None and again.state == "queued"  # the whole write rolled back


def test_database_urls_of_every_documented_form_are_read_and_others_refused() -> None:
    assert database_url("sqlite:///relay.db").drivername == "sqlite+pysqlite"
    assert database_url("sqlite+aiosqlite:///relay.db").drivername == "sqlite+pysqlite"
    for url in ("postgres://u:p@db/relay", "postgresql://u:p@db/relay"):
        assert database_url(url).drivername == "postgresql+asyncpg"
    with pytest.raises(ConfigError, match="RELAY_DATABASE_URL"):
        database_url("not a url")


async def test_a_write_waits_for_another_processs_lock_without_holding_the_loop(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "relay.db"
    store = await Store.open(f"sqlite:///{path}")
    await store.admit_run(row("run_locked"))
    other = sqlite3.connect(path, isolation_level=None)  # `relay reap` from cron, say
    other.execute("BEGIN IMMEDIATE")  # holds the write lock
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    counting = asyncio.create_task(ticker())
    writing = asyncio.create_task(store.update_run("run_locked", state="running"))
    await asyncio.sleep(0.3)
    assert not writing.done() and ticks >= 5  # waiting, and the loop kept turning
    other.execute("COMMIT")
    assert await asyncio.wait_for(writing, 5)
    # Past the busy wait, the lock error reaches the caller.
    monkeypatch.setattr("relay.store.sqlite.group_commit.BUSY_WAIT_S", 0.2)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(OperationalError, match="locked"):
        await store.update_run("run_locked", state="succeeded")
    other.execute("ROLLBACK")
    other.close()
    counting.cancel()
    assert (await store.get_run("run_locked")).state == "running"  # type: ignore[index]
    await store.close()


async def test_a_unique_index_refusal_is_a_duplicate_on_both_engines(store: Store) -> None:
    # What a second process inserting the same key at the same moment meets: not the
    # pre-check, the unique index (here: the same run id twice).
    await store.admit_run(row("run_twice"))
    with pytest.raises(DuplicateKey):
        await store.admit_run(row("run_twice"))


# -- the daily counters (token_days) ---------------------------------------------------


async def _days(store: Store) -> dict[tuple[str, int], tuple[int, float]]:
    def read(conn: sa.Connection) -> dict[tuple[str, int], tuple[int, float]]:
        rows = conn.execute(sa.select(token_days)).all()
        return {(t, int(day)): (int(n), round(float(usd), 9)) for t, day, n, usd in rows}

    return await store.read(read)


async def _scanned(store: Store) -> dict[tuple[str, int], tuple[int, float]]:
    """What the daily limits read before version 6, from every run: counted in Python."""
    columns = (runs.c.token, runs.c.created_at, runs.c.state, runs.c.reserved_usd, runs.c.cost_usd)
    found = await store.read(lambda conn: conn.execute(sa.select(*columns)).all())
    days: dict[tuple[str, int], tuple[int, float]] = {}
    for token, created, state, reserved, cost in found:
        key = (token, int(created / 86_400))
        count, usd = days.get(key, (0, 0.0))
        days[key] = (count + 1, usd + (reserved if state in ACTIVE else cost))
    return {key: (count, round(usd, 9)) for key, (count, usd) in days.items()}


async def test_the_daily_counters_follow_every_kind_of_write(store: Store) -> None:
    day = 20_000 * 86_400.0
    runs_ = [  # (id, token, created_at, reserved_usd)
        ("run_a", "alice", day + 10, 0.5),
        ("run_b", "alice", day + 20, 0.25),
        ("run_c", "bob", day + 30, 1.0),
        ("run_d", "alice", day + 86_400 + 5, 0.125),  # the next day
        ("run_e", "alice", day + 86_399.9995, 0.0625),  # the day's last millisecond
    ]
    for run_id, token, created, reserved in runs_:
        await store.admit_run(
            row(run_id, token=token, created_at=created, reserved_usd=reserved, state="starting")
        )
    assert await _days(store) == await _scanned(store)
    assert (await _days(store))[("alice", 20_000)] == (3, 0.8125)

    await store.update_run("run_a", state="running", sandbox_id="sb")  # no change of USD
    assert await store.finish_run(
        "run_a", {"state": RunState.succeeded, "cost_usd": 0.01}, callback=False
    )
    assert await store.update_run("run_c", state="canceled", cost_usd=0.5)  # a DELETE's path
    assert await store.update_run("run_b", state="lost")  # the reaper's: no cost recorded
    assert not await store.update_run("run_b", state="error")  # final stays final: no change
    await store.update_run("run_a", only_if_active=False, cost_usd=0.02)  # corrected later
    await store.write(lambda conn: conn.execute(runs.delete().where(runs.c.id == "run_d")))
    counted, scanned = await _days(store), await _scanned(store)
    assert {key: value for key, value in counted.items() if value[0]} == scanned
    assert counted[("alice", 20_000)] == (3, 0.0825)  # 0.02 + 0 + the active run_e's 0.0625
    assert counted[("bob", 20_000)] == (1, 0.5)
    assert counted[("alice", 20_001)] == (0, 0.0)


async def test_upgrading_from_version_5_counts_the_days_runs_there_are(database_url: str) -> None:
    now = time.time()

    def version_5(conn: sa.Connection) -> None:  # today's tables, less what version 6 added
        metadata.create_all(conn, tables=[t for t in metadata.sorted_tables if t is not token_days])
        conn.execute(meta.insert().values(key="schema_version", value="5"))
        for i in range(4):  # three of them ended at $0.1 each, one still running at $1
            state = "running" if i == 3 else "succeeded"
            values = row(f"run_{i}", token="ops", state=state, cost_usd=0.1, reserved_usd=1.0)
            conn.execute(runs.insert().values(**values.columns()))
        old = row("run_old", token="ops", created_at=now - 86_400)
        conn.execute(runs.insert().values(**old.columns()))

    old = await Store.open(database_url, migrate=False)
    try:
        await old.write(version_5)
    finally:
        await old.close()
    store = await Store.open(database_url)
    try:
        assert await store.schema_version() == SCHEMA_VERSION
        today = int(now / 86_400)
        assert (await _days(store))[("ops", today)] == (4, 1.3)
        assert await _days(store) == await _scanned(store)
        limits = Admission(None, None, 5, 1.5, now)
        await store.admit_run(row("run_5", token="ops", reserved_usd=0.2), limits)  # 1.5 of 1.5
        with pytest.raises(LimitReached, match="runs_per_day"):
            await store.admit_run(row("run_6", token="ops"), limits)
        with pytest.raises(LimitReached, match="usd_per_day"):
            await store.admit_run(
                row("run_7", token="ops", reserved_usd=0.01), Admission(None, None, 9, 1.5, now)
            )
    finally:
        await store.close()


async def test_a_run_reads_back_as_the_record_it_was_admitted_as(store: Store) -> None:
    admitted = row("run_typed", stdout="é\n", callback_url="https://x.test/", cost_usd=0.25)
    await store.admit_run(admitted)
    read = await store.get_run("run_typed")
    assert read == dataclasses.replace(admitted, stdout_bytes=3, stderr_bytes=0)
    assert await store.update_run("run_typed", state="succeeded", exit_code=0)
    listed, _ = await store.list_runs("t", state=None, job=None, limit=5, cursor=None)
    assert listed == [dataclasses.replace(read, state="succeeded", exit_code=0, stdout="")]
    assert read.changed(state="lost") == dataclasses.replace(read, state="lost")
    with pytest.raises(TypeError):  # a misspelt column is refused as the record is made
        read.changed(sandbox_idd="sb")  # type: ignore[call-arg]


def test_a_new_runs_record_is_the_one_its_fields_make_and_refuses_a_wrong_column() -> None:
    made = row("run_new", callback_url="https://x.test/")
    values = {name: value for name, value in vars(made).items() if name != "id"}
    new = RunRecord.new("run_new", **values)
    assert new == made and list(vars(new).items()) == list(vars(made).items())  # column order
    assert RunRecord.new("run_text", **{**values, "state": "running"}).state is RunState.running
    with pytest.raises(TypeError, match="no column"):
        RunRecord.new("run_bad", **values, sandbox_idd="sb")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="needs"):
        RunRecord.new("run_bad", **{k: v for k, v in values.items() if k != "token"})


@pytest.mark.postgres
async def test_a_postgresql_that_stops_answering_is_a_store_failure_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server frozen (a partition: connections open, no answer): a read is a store
    failure (503 store_unavailable) within the statement bound, not a wait without end,
    and the store serves again once the server answers."""
    monkeypatch.setattr(database, "POSTGRES_STATEMENT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(database, "POSTGRES_CONNECT_TIMEOUT_S", 1.0)
    with own_postgres() as (outage, url):
        store = await Store.open(url)
        try:
            await store.heartbeat("replica")  # a pooled connection, open
            outage.freeze()
            try:
                started = time.monotonic()
                with pytest.raises(Exception) as refused:
                    await asyncio.wait_for(store.get_run("run_x"), 8)
                assert is_store_failure(refused.value), repr(refused.value)
                with pytest.raises((TimeoutError, database.StoreTimeout)):
                    await store.ping()  # what /readyz asks: bounded too
                assert time.monotonic() - started < 6
            finally:
                outage.thaw()
            assert await store.get_run("run_x") is None
        finally:
            await store.close()
