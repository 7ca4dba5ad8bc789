"""A finished run's outcome survives a shutdown with the store down (issue 37, item 1).

A run that ended while the store refused its final write was ``running`` after the drain
gave up ("shutting down, so giving up"), and the next start marked it ``lost``: its output
was gone. Now the stopping relay writes it to the spool in its state directory (a file per
run, fsynced, bounded, 0600 in a 0700 folder), and the next start replays it into the store
before its reaper marks anything lost. Tested with the relay's SQLite file on a real full
disk (a tmpfs, as root), and with a real PostgreSQL stopped across a SIGTERM and a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest

from relay.auth import Principal, new_token
from relay.run_state import RunState
from relay.runs.models import RunRequest
from relay.runtime import Relay
from testing.postgres import own_postgres
from testing.relay_server import RelayProcess
from tests.conftest import make_settings, new_database
from tests.runs.test_final_writes import WAITING_JOB, refuse_writes, release, small_tmpfs

PRINCIPAL = Principal(name="ops", command=True)
BIG = 200_000
"""Bytes the second run prints: more than the spool's bound leaves it."""
BIG_JOB = f"trap 'yes x | head -c {BIG}; exit 0' USR1; while :; do sleep 0.05; done"
"""Prints :data:`BIG` bytes and succeeds when the test says (once the disk is full)."""


async def _final_here(relay: Relay, run_ids: list[str]) -> None:
    """Until every run reads final on this relay (from memory: the store refuses)."""
    for _ in range(150):
        seen = [await relay.service.find(run_id) for run_id in run_ids]
        if all(run is not None and run.state.final for run in seen):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the runs never ended")


async def _stored_running(relay: Relay, run_ids: list[str]) -> None:
    """Until every run's ``running`` state is in the store (a busy machine starts late)."""
    for _ in range(600):
        seen = [await relay.store.get_run(run_id) for run_id in run_ids]
        if all(run is not None and run.state == RunState.running for run in seen):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the runs never ran")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_outcomes_the_full_disk_refused_are_spooled_at_shutdown_and_replayed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_tmpfs(tmp_path / "disk", "3m") as disk:
        settings = make_settings(
            tmp_path,
            database_url=f"sqlite:///{disk / 'relay.db'}",  # the state dir: the same disk
            local_isolation="bwrap",
            spool_max_bytes=128 * 1024,
            drain_s=0.0,
        )
        new_token(settings.tokens_file, "ops", command=True)
        filler = disk / "filler"
        spool = disk / "spool"
        small = RunRequest(command=["sh", "-c", WAITING_JOB], wait=False)
        big = RunRequest(command=["sh", "-c", BIG_JOB], wait=False)
        with caplog.at_level(logging.WARNING, "relay.spool"):
            async with Relay.open(settings) as relay:
                await relay.start()
                assert (spool / "reserve").stat().st_size == 128 * 1024  # kept for this moment
                runs = [
                    (await relay.service.submit(PRINCIPAL, request, None))[0].id
                    for request in (small, big)
                ]
                await _stored_running(relay, runs)
                # The store's checkpoints held (one that starts the WAL over lets a write
                # land in room its file holds), the disk fills, the WAL's last room is
                # written up: the final writes are refused. Only then do the jobs end.
                assert relay.store.checkpointer is not None
                relay.store.checkpointer.stop()
                with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as out:
                    while True:
                        out.write(b"\0" * 65536)
                await asyncio.to_thread(refuse_writes, disk / "relay.db")
                await asyncio.to_thread(release, runs[0])
                await asyncio.to_thread(release, runs[1], BIG_JOB)
                await _final_here(relay, runs)
            # Leaving the relay is what SIGTERM does: the drain, then the spool.
        # Neither outcome fits the full disk: both are spooled.
        files = sorted(spool.glob("run_*.json"))
        spooled = {path.stem for path in files}
        assert spooled == set(runs)
        said = {r.run_id: r for r in caplog.records if r.name == "relay.spool"}  # type: ignore[attr-defined]
        assert set(said) == spooled, "each spooled run is logged at shutdown"
        line = said[runs[1]]
        assert (line.state, line.exit_code) == ("succeeded", 0)  # type: ignore[attr-defined]
        assert line.stdout_bytes < BIG and line.stderr_bytes == 0  # type: ignore[attr-defined]
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700
        assert {stat.S_IMODE(path.stat().st_mode) for path in files} == {0o600}
        assert sum(path.stat().st_size for path in files) <= 128 * 1024  # bounded
        stored = json.loads((spool / f"{runs[1]}.json").read_text())["values"]
        assert stored["stdout_truncated"] and 0 < len(stored["stdout"]) < BIG

        filler.unlink()  # the operator frees the disk, and starts the relay again
        async with Relay.open(settings) as again:
            await again.start()
            first = await again.store.get_run(runs[0])
            second = await again.store.get_run(runs[1])
            assert first is not None and second is not None
            assert (first.state, first.exit_code, first.stdout) == ("failed", 3, "kept\n")
            assert second.state == "succeeded" and second.stdout_truncated
            assert second.stdout == stored["stdout"]
            await again.reaper.sweep()  # its reaper, later: nothing of theirs is lost
            assert (await again.store.get_run(runs[0])).state == "failed"  # type: ignore[union-attr]
            assert list(spool.glob("run_*.json")) == []


@pytest.mark.slow
@pytest.mark.postgres
def test_an_outcome_survives_a_sigterm_with_postgresql_stopped_and_a_restart(
    tmp_path: Path,
) -> None:
    with own_postgres() as (server, server_url):
        url = asyncio.run(new_database(server_url))
        relay = RelayProcess(
            tmp_path / "relay", database_url=url, local_isolation="bwrap", drain_s=1,
            reap_interval_s=1,
        )  # fmt: skip
        token = relay.add_token("ops", command=True)
        relay.start()
        try:
            body = {
                "command": ["sh", "-c", "sleep 1; echo out; echo err >&2; exit 3"],
                "wait": False,
            }
            run_id = relay.post(token, body).json()["id"]
            for _ in range(100):
                if relay.get(token, f"/v1/runs/{run_id}").json()["state"] == "running":
                    break
                time.sleep(0.05)
            time.sleep(0.2)  # the `running` state is stored
            server.stop()
            seen: dict[str, object] = {}
            for _ in range(100):  # it ends; the store refuses its final write
                answer = relay.get(token, f"/v1/runs/{run_id}")  # 503 until it ends
                if answer.status_code == 200 and answer.json()["state"] == "failed":
                    seen = answer.json()
                    break
                time.sleep(0.1)
            assert seen["exit_code"] == 3  # from the relay's memory
            relay.stop()  # SIGTERM, PostgreSQL still stopped
            spooled = [json.loads(line) for line in relay.log().splitlines() if "spooled" in line]
            assert [(e["run_id"], e["state"], e["exit_code"]) for e in spooled] == [
                (run_id, "failed", 3)
            ]
            assert (spooled[0]["stdout_bytes"], spooled[0]["stderr_bytes"]) == (4, 4)
            server.start()
            relay.start()
            answer = relay.get(token, f"/v1/runs/{run_id}").json()
            assert (answer["state"], answer["exit_code"]) == ("failed", 3)
            assert (answer["stdout"], answer["stderr"]) == ("out\n", "err\n")
            time.sleep(6)  # past the beats a replica waits before judging the old one dead
            assert relay.get(token, f"/v1/runs/{run_id}").json()["state"] == "failed"
            assert list((relay.root / "spool").glob("run_*.json")) == []
        finally:
            relay.stop()


def test_a_bare_spool_round_trip_keeps_every_column(tmp_path: Path) -> None:
    """What a spool file holds comes back as it was (the run's state as its enum)."""
    from relay.runs.spool import Spool, Spooled
    from testing.rows import run_row

    spool = Spool(tmp_path / "spool", 65_536)
    run = run_row("run_round", request='{"command":["x"]}', callback_url="https://x.example")
    values = {"state": RunState.failed, "exit_code": 2, "stdout": "é\n", "stderr": ""}
    assert spool.write([Spooled(run, values)]) == ["run_round"]  # type: ignore[arg-type]
    [back] = spool.load()
    assert back.final == run.changed(**values)  # type: ignore[arg-type]
    assert back.values["state"] is RunState.failed
    spool.remove("run_round")
    assert spool.load() == []
