"""The spool (relay/runs/spool.py) attacked: files in it the relay did not write, or not as
it writes them, never stop a start nor finish a run they do not name, and stay in place for
the operator.

A real relay (real SQLite) is opened and started over a state directory whose ``spool``
folder holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.auth import new_token
from relay.run_state import RunState
from relay.runs.spool import Spool, Spooled
from relay.runtime import Relay
from relay.store.records import RunValues
from testing.rows import run_row
from tests.conftest import make_settings

FORGED: RunValues = {"state": RunState.succeeded, "exit_code": 0, "stdout": "forged\n"}


def _spooled(folder: Path, run_id: str, values: RunValues) -> Path:
    """The file the relay itself would spool for ``run_id`` (a running run's outcome)."""
    [written] = Spool(folder, 1 << 20).write([Spooled(run_row(run_id), values)])
    return folder / f"{written}.json"


@contextlib.contextmanager
def _unblocked(fifo: Path) -> Iterator[None]:
    """Whatever happens, a reader blocked opening ``fifo`` gets its end of file."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_hostile_spool_files_never_stop_a_start_and_are_left_for_the_operator(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(tmp_path, providers=["memory"], drain_s=0.0)
    new_token(settings.tokens_file, "ops", command=True)
    folder = settings.state_directory() / "spool"
    folder.mkdir(mode=0o700)
    (folder / "run_list.json").write_text("[1, 2]")
    (folder / "run_shape.json").write_text('{"format": 1, "run": 5, "values": []}')
    (folder / "run_text.json").write_bytes(b"\xff\xfe not json")
    os.mkfifo(folder / "run_fifo.json", 0o600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(_spooled(elsewhere, "run_linked", FORGED), folder / "run_linked.json")
    hostile = sorted(path.name for path in folder.iterdir())
    with _unblocked(folder / "run_fifo.json"), caplog.at_level(logging.ERROR, "relay.spool"):
        async with Relay.open(settings) as relay:
            await relay.store.admit_run(run_row("run_linked"))
            await asyncio.wait_for(relay.start(), 20)  # a FIFO must not hang it
            linked = await relay.store.get_run("run_linked")
            assert linked is not None and linked.stdout != "forged\n", "a link was followed"
    left = sorted(path.name for path in folder.iterdir() if path.name != "reserve")
    assert left == hostile
    said = {
        getattr(record, "path", record.getMessage())
        for record in caplog.records
        if record.levelno >= logging.ERROR
    }
    assert said == {str(folder / name) for name in hostile}, "each one named for the operator"


async def test_a_spool_file_naming_another_run_never_finishes_that_run(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, providers=["memory"], drain_s=0.0)
    new_token(settings.tokens_file, "ops", command=True)
    folder = settings.state_directory() / "spool"
    folder.mkdir(mode=0o700)
    _spooled(folder, "run_victim", FORGED).rename(folder / "run_mine.json")
    async with Relay.open(settings) as relay:
        await relay.store.admit_run(run_row("run_victim"))
        await relay.store.admit_run(run_row("run_mine"))
        await asyncio.wait_for(relay.start(), 20)
        victim = await relay.store.get_run("run_victim")
        assert victim is not None and victim.stdout != "forged\n"
    assert (folder / "run_mine.json").exists(), "left for the operator"
    assert json.loads((folder / "run_mine.json").read_text())["run"]["id"] == "run_victim"
