"""The admin's readings of the store on a real SQLite file and a real PostgreSQL: how runs
ended per job and per provider (counts, causes, percentiles, the newest failure), and the
listing's search, several states and the request it carries."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from relay.store.database import MAX_LISTED_REQUEST_CHARS, Store
from relay.store.outcomes import MAX_GROUPS, Outcomes
from relay.store.records import RunRecord
from relay.store.reports import Reports

NOW = time.time()


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    opened = await Store.open(database_url)
    yield opened
    await opened.close()


def run(run_id: str, **values: Any) -> RunRecord:
    created = values.pop("created_at", NOW - 60)
    return RunRecord(**{
        "id": run_id, "token": "nightly", "job": "build", "provider": "local",
        "state": "succeeded", "request_hash": "h", "timeout_s": 60.0, "created_at": created,
        "deadline": created + 60, "owner": "me", "stdout": "", "stderr": "", "timings": "{}",
    } | values)  # fmt: skip


async def add(store: Store, *records: RunRecord) -> None:
    for record in records:
        await store.admit_run(record)


async def test_outcomes_count_every_end_state_per_job_and_provider(store: Store) -> None:
    await add(
        store,
        *(run(f"run_ok{i}", duration_ms=(i + 1) * 100, cost_usd=0.5) for i in range(10)),
        run("run_exit1", state="failed", exit_code=1, duration_ms=5000, created_at=NOW - 50),
        run("run_exit1b", state="failed", exit_code=1, created_at=NOW - 40),
        run("run_oom", state="failed", exit_code=137, error_code="out_of_memory"),
        run("run_slow", state="timed_out", created_at=NOW - 45),
        run(
            "run_err",
            state="error",
            error_code="provider_unavailable",
            provider="e2b",
            error_message="<b>down</b>",
            created_at=NOW - 30,
        ),
        run("run_lost", state="lost", error_code="sandbox_lost", provider="e2b"),
        run("run_stop", state="canceled"),
        run("run_going", state="running"),
        run("run_cmd", job=None, state="failed", exit_code=2),
        run("run_old", state="failed", exit_code=9, created_at=NOW - 7200),  # outside
        run("run_new", state="failed", exit_code=9, created_at=NOW + 10),  # after `until`
    )
    outcomes = Outcomes(store)
    report = await outcomes.report("job", NOW - 3600, NOW)
    assert [group.name for group in report.groups] == ["build", None]
    build = report.groups[0]
    counts = (build.runs, build.active, build.succeeded, build.failed, build.canceled)
    assert counts == (18, 1, 10, 6, 1)
    assert build.causes == {
        "exit 1": 2,
        "out_of_memory": 1,
        "provider_unavailable": 1,
        "sandbox_lost": 1,
        "timed_out": 1,
    }
    assert next(iter(build.causes)) == "exit 1"  # most first
    assert build.usd == pytest.approx(5.0)
    # Nearest rank over the 11 durations (100 … 1000 ms, and 5000 ms).
    assert build.duration_ms == {50: 600, 95: 5000}
    last = build.last_failure
    assert last is not None and last.run_id == "run_err"
    assert (last.state, last.error_code) == ("error", "provider_unavailable")
    assert last.error_message == "<b>down</b>"
    command = report.groups[1]
    assert command.causes == {"exit 2": 1} and command.duration_ms == {}
    by_provider = await outcomes.report("provider", NOW - 3600, NOW)
    assert {group.name: group.failed for group in by_provider.groups} == {"local": 5, "e2b": 2}
    assert by_provider.omitted == 0
    empty = await outcomes.report("job", NOW + 3600, NOW + 7200)
    assert empty.groups == [] and empty.omitted == 0


async def test_one_run_is_both_percentiles_and_a_report_keeps_the_busiest_groups(
    store: Store,
) -> None:
    await add(store, run("run_one", duration_ms=42))
    (only,) = (await Outcomes(store).report("job", NOW - 3600, NOW)).groups
    assert only.duration_ms == {50: 42, 95: 42} and only.last_failure is None
    await add(
        store, *(run(f"run_j{i}", job=f"job{i:03}") for i in range(MAX_GROUPS + 1)),
        run("run_busy", job="job000"),
    )  # fmt: skip
    report = await Outcomes(store).report("job", NOW - 3600, NOW)
    assert len(report.groups) == MAX_GROUPS and report.omitted == 2
    assert [group.name for group in report.groups[:2]] == ["job000", "build"]


async def test_health_counts_failed_and_timed_out_as_failures(store: Store) -> None:
    await add(
        store,
        run("run_a"),
        run("run_b", state="failed", exit_code=1),
        run("run_c", state="timed_out"),
        run("run_d", state="error", error_code="internal"),
        run("run_e", state="canceled"),
    )
    assert await Reports(store).provider_outcomes(NOW - 3600) == {"local": (5, 1, 3)}


async def test_a_listing_finds_by_id_or_name_and_by_several_states(store: Store) -> None:
    await add(
        store,
        run("run_a1", job="backup-db", token="nightly"),
        run("run_b2", job="report", token="Ops_Team", state="failed", exit_code=1),
        run("run_c3", job="report", token="nightly", state="timed_out"),
        run("run_d4", job=None, token="nightly", state="running"),
        run("run_e5", job="a%_b", token="x"),
    )

    async def ids(**options: Any) -> set[str]:
        page, _ = await store.list_runs(
            options.pop("token", None), job=None, limit=50, cursor=None, **options
        )
        return {record.id for record in page}

    assert await ids(state=None, search="run_c3") == {"run_c3"}
    assert await ids(state=None, search="run_c") == set()  # an id only whole
    assert await ids(state=None, search="REPO") == {"run_b2", "run_c3"}  # any case
    assert await ids(state=None, search="ops_") == {"run_b2"}  # a token's name
    assert await ids(state=None, search="%") == {"run_e5"}  # a wildcard is a character
    assert await ids(state=None, search="_") == {"run_b2", "run_e5"}
    assert await ids(state=None, search="backup", token="x") == set()  # within the token
    assert await ids(state=("failed", "timed_out")) == {"run_b2", "run_c3"}
    assert await ids(state="running") == {"run_d4"}
    assert await ids(state=("failed", "timed_out"), search="nightly") == {"run_c3"}


async def test_a_listing_carries_a_short_request_and_leaves_a_long_one_out(store: Store) -> None:
    short = json.dumps({"job": "build", "params": {"branch": "main"}, "env": ["API_KEY"]})
    long = json.dumps({"job": "build", "params": {"text": "x" * MAX_LISTED_REQUEST_CHARS}})
    await add(
        store,
        run("run_short", request=short),
        run("run_long", request=long),
        run("run_none"),
    )
    page, _ = await store.list_runs(None, state=None, job=None, limit=10, cursor=None)
    listed = {record.id: record.request for record in page}
    assert listed == {"run_short": short, "run_long": None, "run_none": None}
    assert (await store.get_run("run_long")).request == long  # type: ignore[union-attr]
