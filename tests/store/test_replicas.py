"""Two relay processes on one PostgreSQL: what must hold across replicas, holds."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from testing.host import sleep_marker
from testing.postgres import own_postgres
from testing.relay_server import RelayProcess
from tests.conftest import new_database

pytestmark = [pytest.mark.postgres, pytest.mark.slow]  # needs a relay process: seconds


@pytest.fixture
def pair(tmp_path: Path, postgres_url: str) -> Iterator[tuple[RelayProcess, RelayProcess]]:
    import asyncio

    url = asyncio.run(new_database(postgres_url))
    shared = {"database_url": url, "local_root": tmp_path / "sandboxes", "reap_interval_s": 1, "drain_s": 1,
              "local_isolation": "bwrap"}  # fmt: skip
    first = RelayProcess(tmp_path / "a", **shared)
    first.add_token("ops", command=True)
    first.add_token("capped", command=True, limits={"max_concurrent": 2})
    second = RelayProcess(tmp_path / "b", tokens_file=first.tokens_file, **shared)
    second.tokens = first.tokens
    first.start()
    second.start()
    yield first, second
    first.stop()
    second.stop()


def sleeping(marker: str) -> list[str]:
    return ["sleep", marker]


def alive(marker: str) -> bool:
    """Whether a job sleeps ``marker`` (a :func:`sleep_marker`: no other run's does)."""
    return any(p.info["cmdline"] == sleeping(marker) for p in psutil.process_iter(["cmdline"]))


def test_one_key_sent_to_both_replicas_is_one_run(pair: tuple[RelayProcess, RelayProcess]) -> None:
    first, second = pair
    token = first.tokens["ops"]
    body = {"command": ["sh", "-c", "sleep 1; echo once"]}

    def send(i: int) -> str:
        server = first if i % 2 else second
        answer = server.post(token, body, **{"Idempotency-Key": "shared-key"})
        assert answer.status_code in (200, 202), answer.text
        run_id: str = answer.json()["id"]
        return run_id

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        ids = set(pool.map(send, range(10)))
    assert len(ids) == 1
    assert len(first.get(token, "/v1/runs").json()["runs"]) == 1
    assert second.wait_final(token, ids.pop())["stdout"] == "once\n"


def test_a_run_is_read_and_canceled_through_the_other(
    pair: tuple[RelayProcess, RelayProcess],
) -> None:
    first, second = pair
    token = first.tokens["ops"]
    marker = sleep_marker(361)
    run = first.post(token, {"command": sleeping(marker), "wait": False}).json()
    for _ in range(100):
        state = second.get(token, f"/v1/runs/{run['id']}").json()["state"]
        if state == "running" and alive(marker):
            break
        time.sleep(0.1)
    canceled = second.delete(token, f"/v1/runs/{run['id']}")
    assert canceled.status_code == 200 and canceled.json()["state"] == "canceled"
    time.sleep(0.5)
    assert not alive(marker)
    assert first.wait_final(token, run["id"])["state"] == "canceled"


def test_a_dead_replicas_runs_are_reaped_by_the_other(
    pair: tuple[RelayProcess, RelayProcess],
) -> None:
    first, second = pair
    token = first.tokens["ops"]
    markers = [sleep_marker(362 + i) for i in range(3)]
    runs = [first.post(token, {"command": sleeping(m), "wait": False}).json() for m in markers]
    for _ in range(100):
        if all(map(alive, markers)):
            break
        time.sleep(0.1)
    first.kill()
    deadline = time.monotonic() + 20
    states: set[str] = set()
    while time.monotonic() < deadline:
        states = {second.get(token, f"/v1/runs/{r['id']}").json()["state"] for r in runs}
        if states == {"lost"}:
            break
        time.sleep(0.25)
    assert states == {"lost"}
    assert not any(map(alive, markers))
    sandboxes = first.root.parent / "sandboxes"
    assert not any(sandboxes.iterdir()), "the dead replica's sandbox folders were not reaped"


def test_limits_hold_across_replicas(pair: tuple[RelayProcess, RelayProcess]) -> None:
    first, second = pair
    token = first.tokens["capped"]
    marker = sleep_marker(370)

    def send(i: int) -> int:
        server = first if i % 2 else second
        return server.post(token, {"command": sleeping(marker), "wait": False}).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(send, range(8)))
    assert sorted(statuses) == [202, 202] + [429] * 6
    for run in (
        first.get(token, "/v1/runs", state="running").json()["runs"]
        + first.get(token, "/v1/runs", state="queued").json()["runs"]
        + first.get(token, "/v1/runs", state="starting").json()["runs"]
    ):
        second.delete(token, f"/v1/runs/{run['id']}")


def test_a_database_outage_kills_no_healthy_run(tmp_path: Path) -> None:
    """Both replicas lose the store for longer than the heartbeat window; when it is back,
    neither judges the other dead before it could write a beat: every run lives on."""
    import asyncio

    with own_postgres() as (outage, server_url):
        url = asyncio.run(new_database(server_url))
        shared = {"database_url": url, "local_root": tmp_path / "sandboxes", "reap_interval_s": 1,
                  "drain_s": 1, "local_isolation": "bwrap"}  # fmt: skip
        first = RelayProcess(tmp_path / "a", **shared)
        first.add_token("ops", command=True)
        second = RelayProcess(tmp_path / "b", tokens_file=first.tokens_file, **shared)
        second.tokens = first.tokens
        token = first.tokens["ops"]
        first.start()
        second.start()
        try:
            markers = [sleep_marker(380 + i) for i in range(4)]
            runs = [
                server.post(token, {"command": sleeping(m), "wait": False}).json()
                for m, server in zip(markers, [first, second] * 2, strict=True)
            ]
            for _ in range(100):
                if all(map(alive, markers)):
                    break
                time.sleep(0.1)
            time.sleep(0.5)  # the `running` writes are stored
            outage.stop()
            time.sleep(6)  # longer than 3 missed beats (1 s each) and a second
            outage.start()
            time.sleep(8)  # several sweeps on both replicas
            assert all(map(alive, markers)), "a healthy run was killed"
            states = {first.get(token, f"/v1/runs/{r['id']}").json()["state"] for r in runs}
            assert states == {"running"}
            for run in runs:
                first.delete(token, f"/v1/runs/{run['id']}")
        finally:
            first.stop()
            second.stop()
