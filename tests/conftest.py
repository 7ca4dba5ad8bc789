"""Shared fixtures: clean environment, settings in a temp folder, tokens, relay servers.

The suite runs in worker processes (``pytest -n``, pytest-xdist; `make test` says how
many), so a test never assumes it is the only one running:

- what a test makes goes under ``tmp_path`` / ``tmp_path_factory`` (each worker has its
  own), or under a name it draws at random; never a fixed path, port, process name,
  network namespace or address that another test could use at the same time;
- a port comes from the kernel (bind port 0, or :func:`testing.relay_server.free_port` with
  a retry when a start finds it taken); what it checks on the host (process table, temp
  folder, cgroups) it finds by a marker of its own, not by counting everything there (a job's
  process by a :func:`testing.host.sleep_marker`); sandbox uids come from
  :func:`testing.host.uid_range`. Another copy of the suite (another clone) may run beside
  it, and a killed run's leftovers may still be there;
- a session fixture is per worker: ``postgres_url`` is a server of the worker's own;
- tests that share a module- or class-scoped fixture (a relay process, a fake provider)
  run in one worker, in order (they get an ``xdist_group`` of their module below); the
  others are spread one by one;
- a test that starts its own PostgreSQL (``own_postgres``) is marked ``postgres``; one
  that needs Chromium ``browser``; Node ``node``; bubblewrap's private network or test
  hosts ``attack``. `make check` leaves those out (pyproject.toml: markers).
"""

from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from testing import postgres
from testing.postgres import new_database, postgres_url
from testing.rigs import RIGS
from testing.settings import REPO, make_settings

__all__ = ["REPO", "database_url", "make_settings", "new_database", "postgres_url"]

SDK_VARIABLES = ("RELAY_", *(prefix for rig in RIGS.values() for prefix in rig.environment))
"""The relay's variables and those each provider's SDK reads by itself (its rig says which)."""

pytest_plugins = ["tests.parallel"]

SPOOL_HERE = Path.cwd() / "spool"
"""Where a relay built with no state folder keeps its spool (a 16 MiB ``reserve``): its
state folder is then the working directory (``Settings.state_directory`` with PostgreSQL or
an in-memory database), the clone. A test keeps its state under ``tmp_path``."""
_spool_seen = SPOOL_HERE.exists()
"""Already there (left by an older run): not this session's to report."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and "postgres_url" in item.fixturenames:
            item.add_marker(pytest.mark.postgres)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every module, SDK and test item) lives as long as the
    process: set it aside, so each test's collection below only walks what tests made
    (a full walk of it all cost ~0.15 s of CPU per test)."""
    gc.collect()
    gc.freeze()


_shared_fixture_ended: list[bool] = [False]
"""Whether a fixture longer-lived than a test ended since the last test began."""


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[object]) -> None:
    if fixturedef.scope != "function":
        _shared_fixture_ended[0] = True


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect after each test, so an unclosed resource fails the test that leaked it
    rather than whichever test the garbage collector happens to run in.

    What earlier tests left alive is set aside first (``gc.freeze``), so the collection
    after the test walks only what the test made: a walk of everything a worker holds cost
    ~10 ms of CPU per test, ~40% of a contract test's. Only the end of a fixture that
    outlives tests (a module's relay, a fake) makes garbage of what is set aside: the next
    test walks everything first."""
    if _shared_fixture_ended[0]:
        _shared_fixture_ended[0] = False
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _no_spool_in_the_working_directory() -> Iterator[None]:
    """Fail the test after which a spool appeared in the working directory (once a worker:
    one stat a test). With workers, the test that made it may be one running beside it."""
    global _spool_seen
    yield
    if not _spool_seen and SPOOL_HERE.exists():
        _spool_seen = True
        pytest.fail(
            f"{SPOOL_HERE} appeared: a relay was built with its state in the working "
            "directory (settings with no state_dir and no SQLite file: use make_settings"
            "(tmp_path) or state_dir=tmp_path). Rerun this module with -p no:xdist to be sure "
            "which test did it, and delete the folder."
        )


@pytest.fixture(autouse=True)
def _postgres_only_when_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that starts a PostgreSQL of its own must say so (`make check` skips those)."""
    with postgres.marked(request.node.get_closest_marker("postgres") is not None):
        yield


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees the developer's RELAY_* variables or provider credentials (but the
    suite's own RELAY_TEST_*: a PostgreSQL a test starts is still required in CI)."""
    for name in list(os.environ):
        if name.startswith("RELAY_TEST_"):
            continue
        if name.startswith(SDK_VARIABLES):
            monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each store test runs on a real SQLite file and on a real PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'relay.db'}"
    else:
        yield await new_database(request.getfixturevalue("postgres_url"))
