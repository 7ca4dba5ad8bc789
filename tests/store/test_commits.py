"""Group commit on SQLite: the writes of one turn of the loop share one commit, and
nobody goes on before their own write is committed (relay/store/sqlite/group_commit.py)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from relay.store.database import DuplicateKey, Store
from relay.store.sqlite.group_commit import MAX_WAIT_TURNS
from testing.rows import run_row


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    opened = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    yield opened
    await opened.close()


def committed_ids(store: Store) -> set[str]:
    """Run ids another process sees: only what is committed."""
    assert store.commits is not None
    path = store.commits.conn.engine.url.database
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as other:
        return {run_id for (run_id,) in other.execute("SELECT id FROM runs")}


def groups(store: Store) -> int:
    assert store.commits is not None
    return store.commits.groups


async def test_writes_of_one_turn_share_one_commit_and_each_returns_committed(
    store: Store,
) -> None:
    before = groups(store)
    seen_at_return: list[set[str]] = []

    async def admit(run_id: str) -> None:
        await store.admit_run(run_row(run_id))
        seen_at_return.append(committed_ids(store))

    await asyncio.gather(*(admit(f"run_{n}") for n in range(20)))
    assert groups(store) == before + 1
    every = {f"run_{n}" for n in range(20)}
    assert all(seen == every for seen in seen_at_return)  # nobody returned before the commit


class Turns:
    """Counts the turns of the event loop while it runs (a task stepping once a turn)."""

    def __init__(self) -> None:
        self.now = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.now += 1

    async def __aenter__(self) -> Turns:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # ticking from the next turn on
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_a_lone_write_is_committed_at_the_next_turn(store: Store) -> None:
    before = groups(store)
    async with Turns() as turns:
        started = turns.now
        await store.admit_run(run_row("run_alone"))
        waited = turns.now - started
    assert groups(store) == before + 1
    assert waited <= 2  # its commit in the next turn, its caller resumed in the one after


async def test_writes_that_keep_coming_in_later_turns_share_a_commit_that_waits_a_bounded_time(
    store: Store,
) -> None:
    """Over HTTP each run writes in turns of its own: while every turn brings the open
    group more writes, its commit waits a turn more, at most MAX_WAIT_TURNS."""
    before = groups(store)
    waited: dict[str, int] = {}

    async def admit(run_id: str, later: int, turns: Turns) -> None:
        for _ in range(later):
            await asyncio.sleep(0)
        started = turns.now
        await store.admit_run(run_row(run_id))
        waited[run_id] = turns.now - started
        assert run_id in committed_ids(store)  # returned committed

    async with Turns() as turns:
        # Two in the first turn, then one in each of the next two: one commit.
        await asyncio.gather(*(admit(f"run_a{n}", n and n - 1, turns) for n in range(4)))
        assert groups(store) == before + 1
        # Two in every turn for twelve turns: the commit still comes, every few turns.
        before = groups(store)
        runs = [(f"run_b{n}", n // 2) for n in range(24)]
        await asyncio.gather(*(admit(run_id, later, turns) for run_id, later in runs))
    assert 12 / (MAX_WAIT_TURNS + 1) <= groups(store) - before < 12
    assert max(waited.values()) <= MAX_WAIT_TURNS + 2


async def test_a_write_that_fails_is_rolled_back_alone(store: Store) -> None:
    await store.admit_run(run_row("run_taken"))
    answers = await asyncio.gather(
        store.admit_run(run_row("run_a")),
        store.admit_run(run_row("run_taken")),  # the unique index refuses it
        store.admit_run(run_row("run_b")),
        return_exceptions=True,
    )
    assert answers[0] is None and answers[2] is None
    assert isinstance(answers[1], DuplicateKey)
    assert committed_ids(store) == {"run_taken", "run_a", "run_b"}


async def test_a_failed_commit_fails_every_write_of_its_group(store: Store) -> None:
    # A deferred foreign key is checked at COMMIT: a real commit that SQLite refuses.
    assert store.commits is not None
    driver = store.commits.conn.connection.driver_connection
    assert driver is not None
    driver.execute("PRAGMA foreign_keys=ON")
    driver.execute("CREATE TABLE parent (id TEXT PRIMARY KEY)")
    driver.execute(
        "CREATE TABLE child (parent TEXT REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)"
    )
    orphan = sa.text("INSERT INTO child VALUES ('nobody')")
    answers = await asyncio.gather(
        store.admit_run(run_row("run_with_orphan")),
        store.write(lambda conn: conn.execute(orphan)),
        return_exceptions=True,
    )
    assert all(isinstance(answer, IntegrityError) for answer in answers), answers
    assert committed_ids(store) == set()
    await store.admit_run(run_row("run_after"))  # the next group is a fresh transaction
    assert committed_ids(store) == {"run_after"}


async def test_a_writer_cancelled_while_its_commit_is_pending_still_learns_it_committed(
    store: Store,
) -> None:
    went_on = asyncio.Event()

    async def submit() -> None:
        await store.admit_run(run_row("run_cancelled_writer"))
        went_on.set()  # e.g. start the run's task: the row exists, so must its task
        await asyncio.sleep(10)

    task = asyncio.create_task(submit())
    await asyncio.sleep(0)  # the write ran and waits for its commit
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert went_on.is_set()
    assert "run_cancelled_writer" in committed_ids(store)


async def test_a_timeout_expiring_while_a_commit_is_pending_is_still_a_timeout(
    store: Store,
) -> None:
    went_on = False
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):  # expires before the group's commit runs
            await store.admit_run(run_row("run_timed_out"))
            went_on = True
            await asyncio.sleep(10)
    assert went_on
    assert "run_timed_out" in committed_ids(store)


async def test_a_read_inside_an_open_group_waits_for_its_commit_and_one_outside_opens_none(
    store: Store,
) -> None:
    await store.admit_run(run_row("run_read"))
    before = groups(store)
    assert await store.get_run("run_read") is not None
    assert groups(store) == before  # a read alone opens no group and takes no write lock

    writing = asyncio.ensure_future(store.update_run("run_read", state="succeeded"))
    await asyncio.sleep(0)  # the update ran inside an open group, not yet committed
    read = await store.get_run("run_read")
    assert read is not None and read.state == "succeeded"
    assert writing.done()  # the read came back only after the group's commit
    assert await writing


async def test_a_full_disk_mid_group_never_reports_a_write_that_was_lost(store: Store) -> None:
    assert store.commits is not None
    driver = store.commits.conn.connection.driver_connection
    assert driver is not None
    await store.admit_run(run_row("run_before"))
    (pages,) = driver.execute("PRAGMA page_count").fetchone()
    driver.execute(f"PRAGMA max_page_count={pages + 2}")  # the "disk" holds two more pages
    huge = run_row("run_huge", stdout="x" * 100_000)
    names = ["run_a", "run_huge", "run_b"]
    answers = await asyncio.gather(
        store.admit_run(run_row("run_a")),
        store.admit_run(huge),
        store.admit_run(run_row("run_b")),
        return_exceptions=True,
    )
    assert isinstance(answers[1], sa.exc.OperationalError)  # "database or disk is full"
    committed = committed_ids(store)
    for name, answer in zip(names, answers, strict=True):
        assert (answer is None) == (name in committed), (name, answer)
    driver.execute("PRAGMA max_page_count=1073741823")
    await store.admit_run(run_row("run_after"))  # the store goes on once there is room
    assert {"run_before", "run_after"} <= committed_ids(store)


async def test_closing_with_a_commit_pending_commits_it_and_still_truncates_the_wal(
    tmp_path: Path,
) -> None:
    path = tmp_path / "relay.db"
    store = await Store.open(f"sqlite:///{path}")
    writing = asyncio.ensure_future(store.admit_run(run_row("run_at_close")))
    await asyncio.sleep(0)  # written inside an open group, its commit not yet run
    assert not writing.done()
    await store.close()
    await writing  # the writer learns its write was committed
    wal = path.with_name("relay.db-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    # The final checkpoint was not kept from finishing by the open group's write lock.
    assert store.checkpointer is not None and store.checkpointer.blocked == 0
    with sqlite3.connect(path) as other:
        assert other.execute("SELECT id FROM runs").fetchall() == [("run_at_close",)]


async def test_a_writer_cancelled_twice_while_its_commit_fails_learns_the_failure(
    store: Store,
) -> None:
    """The commit's error, not a success, whatever the cancellations meanwhile (each writer
    waits on a future of its own); the cancellation is kept for its next await."""
    assert store.commits is not None
    driver = store.commits.conn.connection.driver_connection
    assert driver is not None
    driver.execute("PRAGMA foreign_keys=ON")
    driver.execute("CREATE TABLE parent (id TEXT PRIMARY KEY)")
    driver.execute(
        "CREATE TABLE child (parent TEXT REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)"
    )
    outcome: list[object] = []

    async def write() -> None:
        try:
            await store.admit_run(run_row("run_lost_with_its_group"))
        except IntegrityError as exc:
            outcome.append(exc)
            current = asyncio.current_task()
            assert current is not None
            outcome.append(current.cancelling())
            raise

    task = asyncio.create_task(write())
    orphan = sa.text("INSERT INTO child VALUES ('nobody')")
    other = asyncio.create_task(store.write(lambda conn: conn.execute(orphan)))
    await asyncio.sleep(0)  # both wrote into one group and wait for its commit
    task.cancel()
    task.cancel()
    with pytest.raises(IntegrityError):
        await task
    with pytest.raises(IntegrityError):
        await other
    assert isinstance(outcome[0], IntegrityError) and outcome[1]  # still to be delivered
    assert committed_ids(store) == set()
