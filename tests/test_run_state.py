"""A run's states have one home (relay/run_state.py): the copies that cannot import it are
pinned to it, the store's SQL follows it, and every write of a state is checked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relay import client
from relay.run_state import (
    ACTIVE,
    FAILURES,
    FINAL,
    FIRST,
    TRANSITIONS,
    IllegalTransition,
    RunState,
    transition,
)
from relay.store.database import Store
from relay.store.schema import SCHEMA_VERSION
from testing.rows import run_row

CONSOLE_SCRIPT = Path(__file__).parents[1] / "relay/http/console/static/console.js"

ACTIVE_IN_TRIGGERS = {
    9: ("queued", "starting", "running"),
    10: ("queued", "starting", "running"),  # token_uses: the triggers unchanged
    11: ("queued", "starting", "running"),  # a run's attempts, replicas' breakers: unchanged
    12: ("queued", "starting", "running"),  # artifacts: the triggers unchanged
    13: ("queued", "starting", "running"),  # token_artifacts: the triggers unchanged
}
"""For each schema version, the active states the store's day-count triggers count at their
reservation once a database is migrated to it (relay/store/schema.py builds them from
ACTIVE, in the migration to version 6). A new active state needs a migration that rebuilds
them: a new schema version, and its line here."""


def test_every_state_is_active_or_final_and_has_its_line_in_the_table() -> None:
    assert sorted(ACTIVE + FINAL) == sorted(RunState)
    assert not set(ACTIVE) & set(FINAL)
    assert set(TRANSITIONS) == set(RunState)
    assert all(state.final for state in FINAL) and not any(state.final for state in ACTIVE)


def test_a_final_state_is_never_left_and_any_active_run_can_be_ended() -> None:
    for state in FINAL:
        assert TRANSITIONS[state] == frozenset()
    for state in ACTIVE:  # by a cancel, a fault, the reaper
        assert {RunState.canceled, RunState.error, RunState.lost} <= TRANSITIONS[state]
        assert state not in TRANSITIONS[state]
    assert not TRANSITIONS[RunState.running] & FIRST  # never back to the start


def test_transition_allows_what_the_table_says_and_refuses_the_rest() -> None:
    for state in RunState:
        run = run_row("run_t", state=state)
        for to in RunState:
            if to in TRANSITIONS[state]:
                assert transition(run, to) is to
            else:
                with pytest.raises(IllegalTransition, match=f"run_t \\({state}\\)"):
                    transition(run, to)
    assert transition(None, RunState.starting) is RunState.starting
    assert {RunState.queued, RunState.starting} == FIRST
    with pytest.raises(IllegalTransition, match="a new run cannot become running"):
        transition(None, RunState.running)


def test_the_standard_library_client_knows_the_final_states_of_the_relay() -> None:
    assert {state.value for state in FINAL} == client.FINAL


def test_the_console_script_knows_the_final_states_of_the_relay() -> None:
    found = re.search(r"const FINAL = new Set\((\[[^\]]*\])\);", CONSOLE_SCRIPT.read_text())
    assert found is not None, "console.js no longer declares `const FINAL = new Set([...])`"
    assert sorted(json.loads(found.group(1))) == sorted(state.value for state in FINAL)


def test_the_console_script_knows_which_end_states_are_failures() -> None:
    found = re.search(r'const FAILURES = "([^"]*)";', CONSOLE_SCRIPT.read_text())
    assert found is not None, 'console.js no longer declares `const FAILURES = "..."`'
    assert found.group(1).split(",") == [state.value for state in FAILURES]
    assert set(FAILURES) < set(FINAL)


def test_a_changed_set_of_active_states_comes_with_a_schema_version_that_rebuilds_the_triggers() -> (
    None
):
    assert SCHEMA_VERSION in ACTIVE_IN_TRIGGERS, (
        f"schema version {SCHEMA_VERSION}: say which active states its triggers count "
        "(ACTIVE_IN_TRIGGERS above)"
    )
    assert tuple(ACTIVE) == ACTIVE_IN_TRIGGERS[SCHEMA_VERSION], (
        "ACTIVE changed: the day-count triggers (relay/store/schema.py) still count the old "
        "active states at their reservation. Add a migration that rebuilds them (a new "
        "SCHEMA_VERSION) and its line in ACTIVE_IN_TRIGGERS"
    )


async def test_a_run_read_from_the_store_has_its_state_as_the_enum(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite:///{tmp_path / 'relay.db'}")
    try:
        await store.admit_run(run_row("run_read", state=RunState.starting))
        await store.update_run("run_read", state=RunState.running)
        found = await store.get_run("run_read")
        listed, _ = await store.list_runs(None, state=None, job=None, limit=5, cursor=None)
    finally:
        await store.close()
    assert found is not None and found.state is RunState.running and not found.state.final
    assert [run.state for run in listed] == [RunState.running]
    assert listed[0].state is RunState.running
