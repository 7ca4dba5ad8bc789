"""Bounds a caller can trust (issue 37, item 4): a ``wait: true`` answer comes at the bound
the README gives for it, whatever a provider or the store stops answering.

- create and list both hanging: the 504 comes at ``RELAY_CREATE_TIMEOUT_S`` (it came that
  plus the follow-up sweep's 10 s: 15 s for 5);
- a terminate hanging: the answer waits for it at most ``TERMINATE_WAIT_S`` (2 s; it added
  the provider's terminate timeout: 21 s for a 1 s job), and the sandbox is still ended, by
  the terminate going on beside serving or by the reaper;
- ``/readyz`` fails while the store refuses a run's final write, also when it still takes
  the heartbeat's one-row write.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from relay.auth import Principal, new_token
from relay.http.app import create_app
from relay.providers.aftercare import TERMINATE_WAIT_S
from relay.providers.memory import MemoryProvider, MemoryWorld
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import Store
from testing.rigs import RIGS
from tests.conftest import REPO, make_settings
from tests.runs.test_final_writes import small_tmpfs

SLACK_S = 1.0
"""What a loaded machine may add to a bound."""


@pytest.fixture
def silent_url() -> Iterator[str]:
    """An address whose connections are taken (the kernel's backlog) and never answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["e2b", "cloudflare", "exedev"])
def test_create_and_list_hanging_answer_504_at_the_create_timeout(
    tmp_path: Path, silent_url: str, name: str
) -> None:
    """Through each provider's own client (an SDK, or httpx for the Worker), against an
    address that takes connections and never answers."""
    rig = RIGS[name]
    settings = make_settings(
        tmp_path, providers=[name], create_timeout_s=2, **{**rig.keys, **rig.urls(silent_url)}
    )
    token = new_token(settings.tokens_file, "ops", command=True)
    with TestClient(create_app(settings)) as client:
        started = time.monotonic()
        answer = client.post(
            "/v1/runs", json={"command": ["true"]}, headers={"Authorization": f"Bearer {token}"}
        )
        took = time.monotonic() - started
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "provider_timeout"
    assert took < settings.create_timeout_s + SLACK_S, f"the 504 came after {took:.1f} s"


async def test_a_hanging_terminate_does_not_hold_the_answer_and_the_sandbox_still_ends(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path, providers=["memory"])
    world = MemoryWorld()
    provider = MemoryProvider(settings, world)
    store = await Store.open(settings.database_url)
    service = RunService(settings, store, Catalog.load(REPO / "jobs"), {"memory": provider})
    reaper = Reaper(
        store,
        service.providers,
        settings,
        holds=service.holds,
        instance_id=service.instance_id,
        grace_s=settings.grace_s,
        single_replica=True,
    )
    principal = Principal(name="ops", command=True)
    try:
        world.faults.terminate_hang = True
        started = time.monotonic()
        run, _ = await service.submit(principal, RunRequest(command=["sleep", "1"]), None)
        answer = await service.wait(run.id, settings.max_wait_s)  # what `wait: true` does
        took = time.monotonic() - started
        assert answer.state == "succeeded"
        assert took < 1 + TERMINATE_WAIT_S + SLACK_S, f"answered after {took:.1f} s"
        assert world.alive() == {answer.sandbox_id}  # the terminate goes on, unanswered
        assert provider.aftercare.going == 1
        world.reset()  # the provider answers again: that terminate fails (503) ...
        await provider.aftercare.finish()
        assert world.alive() == {answer.sandbox_id}
        await reaper.sweep()  # ... and the reaper ends the sandbox of a final run
        assert world.alive() == set()
    finally:
        world.reset()
        await service.shutdown()
        await provider.aftercare.finish()
        await store.close()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_readyz_fails_while_the_store_refuses_a_final_write(tmp_path: Path) -> None:
    """The relay's SQLite file on a disk with 64 KiB left: the heartbeat's one-row write
    still lands, a run's 200 KB of output does not."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        settings = make_settings(
            tmp_path,
            database_url=f"sqlite:///{disk / 'relay.db'}",
            state_dir=tmp_path,  # the spool's reserve elsewhere: this disk fills whole
            local_isolation="bwrap",
        )
        token = new_token(settings.tokens_file, "ops", command=True)
        headers = {"Authorization": f"Bearer {token}"}
        body = {"command": ["sh", "-c", "sleep 0.5; yes x | head -c 200000"], "wait": False}
        filler = disk / "filler"
        with TestClient(create_app(settings)) as client:
            assert client.get("/readyz").status_code == 200
            run_id = client.post("/v1/runs", json=body, headers=headers).json()["id"]
            time.sleep(0.2)
            # Every page in the database file first, so what is left is the log's alone.
            with contextlib.closing(sqlite3.connect(disk / "relay.db")) as aside:
                aside.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as out:
                while True:
                    out.write(b"\0" * 65536)
            # Nearly full: room for a heartbeat's page, not for 200 KB of output.
            os.truncate(filler, filler.stat().st_size - 64 * 1024)
            for _ in range(100):  # it ends; the store refuses its final write
                if client.get(f"/v1/runs/{run_id}", headers=headers).json()["state"] != "running":
                    break
                time.sleep(0.1)
            time.sleep(3.1)  # /readyz writes its heartbeat again
            ready = client.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert ready.json()["checks"]["store"] == "refusing final writes (1 run(s) waiting)"
            filler.unlink()
            for _ in range(100):  # the final write lands; ready again
                if client.get("/readyz").status_code == 200:
                    break
                time.sleep(0.1)
            assert client.get("/readyz").status_code == 200
            run = client.get(f"/v1/runs/{run_id}", headers=headers).json()
            assert run["state"] == "succeeded" and len(run["stdout"]) == 200_000


def test_every_bound_a_caller_waits_on_is_in_the_readme() -> None:
    """The README's table of what a caller waits for, each bound beside its setting."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("### What a caller waits for", 1)[1].split("\n\n", 2)[1]
    for bound in (
        "RELAY_CREATE_TIMEOUT_S",
        "timeout_s",
        f"{TERMINATE_WAIT_S:g} s",
        "RELAY_MAX_WAIT_S",
        "RELAY_HEADER_TIMEOUT_S",
        "RELAY_BODY_TIMEOUT_S",
        "RELAY_DRAIN_S",
        "10 s",
    ):
        assert bound in table, f"{bound} is not in the README's bounds"
