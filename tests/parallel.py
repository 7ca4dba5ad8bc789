"""How `make test` spreads the suite over worker processes (``pytest -n N --dist loadgroup``).

A pytest plugin (tests/conftest.py loads it). Tests are sent to workers one by one, except
those that must stay together, which go to one worker as a unit, in file order:

- the tests of a module that use a fixture made once for several tests (scope ``module``,
  ``class`` or ``package``: a relay process, a fake provider, a browser), so that it is
  still made once, and tests that build on an earlier one's runs still see them;
- tests with the same ``@pytest.mark.xdist_group(name)``.

Units go out heaviest first: a ``slow`` test weighs as much as ~30 quick ones, so the
long waits start early instead of trailing at the end.

pytest-xdist 3.8 has ``--dist loadgroup`` but, under pytest 9.2, loses the groups (it
renames node ids, which pytest no longer reads: pytest-xdist#1386), so this plugin
implements it: each worker writes what it collected (id → unit, weight) to a folder the
controller names, and the controller's scheduler reads it before handing out work.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

SHARED_SCOPES = {"module", "class", "package"}
SLOW_WEIGHT = 30
"""A `slow` test (several seconds of waiting) against a quick one (~0.2 s)."""
SLOW_S = 8.0
"""A test that takes longer than this (on a busy machine) is marked ``slow``."""

_PLAN = "relay_parallel_plan"
"""The workerinput key naming the folder where each worker writes its plan."""


def unit_of(item: pytest.Item) -> str:
    """The work unit a test belongs to: its own id, or its group's name."""
    for mark in item.iter_markers("xdist_group"):
        return "group:" + str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if _shares_a_fixture(item):
        return "module:" + item.nodeid.split("::", 1)[0]
    return item.nodeid


def weight_of(item: pytest.Item) -> int:
    return SLOW_WEIGHT if item.get_closest_marker("slow") else 1


def _shares_a_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None or not isinstance(item, pytest.Function):
        return False
    return any(
        definitions[-1].scope in SHARED_SCOPES
        for name in item.fixturenames
        if (definitions := info.name2fixturedefs.get(name))
    )


# --- in the controller ---------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(UnmarkedSlowTests(), "relay-unmarked-slow-tests")
    if config.getvalue("dist") == "loadgroup":
        config.stash[_folder] = Path(tempfile.mkdtemp(prefix="relay-parallel-"))


class UnmarkedSlowTests:
    """Names the tests that took long without the ``slow`` mark: `make check` runs them,
    and its 2 minutes are for quick tests."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords:
            self.seen.append((report.duration, report.nodeid))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.seen:
            terminalreporter.write_sep(
                "-", f"{len(self.seen)} tests took over {SLOW_S:.0f} s without @pytest.mark.slow"
            )
            for duration, nodeid in sorted(self.seen, reverse=True)[:10]:
                terminalreporter.write_line(f"{duration:5.1f} s  {nodeid}")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_folder, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_configure_node(node: WorkerController) -> None:
    folder = node.config.stash.get(_folder, None)
    if folder is not None:
        node.workerinput[_PLAN] = str(folder)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    folder = config.stash.get(_folder, None)
    return None if folder is None else PlannedScheduling(config, log, folder)


_folder = pytest.StashKey[Path]()


class PlannedScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no types
    """pytest-xdist's scope scheduling, with the units and their order from the plan."""

    def __init__(self, config: pytest.Config, log: Any, folder: Path) -> None:
        super().__init__(config, log)
        self._folder = folder
        self._plan: dict[str, tuple[str, int]] | None = None
        self._ordered = False

    def _read_plan(self) -> dict[str, tuple[str, int]]:
        if self._plan is None:
            # Every worker collected the same tests (xdist checks); any one's plan will do.
            written = sorted(self._folder.glob("*.json"))
            plan = json.loads(written[0].read_text()) if written else {}
            self._plan = {nodeid: (unit, weight) for nodeid, (unit, weight) in plan.items()}
        return self._plan

    def _split_scope(self, nodeid: str) -> str:
        planned = self._read_plan().get(nodeid)
        # Not in the plan (no worker wrote one): its module, as --dist loadfile would.
        return planned[0] if planned else "module:" + nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._ordered:  # the first hand-out: heaviest units first, else file order
            plan = self._read_plan()
            units = list(self.workqueue.items())
            units.sort(key=lambda unit: -sum(plan.get(i, ("", 1))[1] for i in unit[1]))
            self.workqueue.clear()
            self.workqueue.update(units)
            self._ordered = True
        super()._assign_work_unit(node)


# --- in each worker ------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist sends the collection to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None or _PLAN not in workerinput:
        return
    plan = {item.nodeid: (unit_of(item), weight_of(item)) for item in session.items}
    folder = Path(workerinput[_PLAN])
    written = folder / f".{workerinput['workerid']}.json"
    written.write_text(json.dumps(plan))
    os.replace(written, folder / f"{workerinput['workerid']}.json")
