"""Fault injection through a real relay process, on every provider a relay process can be
pointed at (its rig: local, and each cloud SDK's fake): whatever fails, no sandbox outlives
its run by more than a reap interval, and every run ends in a final state a user can read."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.runs.reaper import BEATS_BEFORE_JUDGING
from testing.relay_server import RelayProcess
from testing.rigs import RIGS, Rig

# Each test restarts or kills relays and waits out real reap intervals.
pytestmark = pytest.mark.slow

FINAL = {"succeeded", "failed", "timed_out", "canceled", "error", "lost"}
REAP_INTERVAL_S = 1


SHARED = [name for name, rig in RIGS.items() if rig.shared]
"""The rigs whose sandboxes a relay process started here shares (not the memory world)."""
FAULTY = [name for name in SHARED if RIGS[name].faulty]


@pytest.fixture(params=SHARED)
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    with RIGS[request.param].started(tmp_path) as made:
        yield made
        _eventually(lambda: made.alive() == set(), 15, "sandboxes left alive after the test")


@pytest.fixture(params=FAULTY)
def fake_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    with RIGS[request.param].started(tmp_path) as made:
        yield made
        _eventually(lambda: made.alive() == set(), 15, "sandboxes left alive after the test")


def _eventually(check: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(what)


def relay_for(rig: Rig, tmp: Path, **settings: Any) -> RelayProcess:
    server = RelayProcess(
        tmp / "relay", reap_interval_s=REAP_INTERVAL_S, drain_s=1, grace_s=5, **rig.values,
        **settings,
    )  # fmt: skip
    if not server.tokens_file.exists():
        server.add_token("ops", command=True)
    else:
        server.tokens = {"ops": (tmp / "ops-token").read_text()}
    (tmp / "ops-token").write_text(server.tokens["ops"])
    return server


def sleep_body(seconds: int, **extra: Any) -> dict[str, Any]:
    return {"command": ["sleep", str(seconds)], "wait": False, "timeout_s": 120, **extra}


def wait_running(server: RelayProcess, token: str, run_ids: list[str]) -> None:
    def all_running() -> bool:
        states = [server.get(token, f"/v1/runs/{i}").json()["state"] for i in run_ids]
        return all(state == "running" for state in states)

    _eventually(all_running, 30, "runs did not start")


def test_kill_9_mid_runs_then_restart_reaps_everything(rig: Rig, tmp_path: Path) -> None:
    server = relay_for(rig, tmp_path).start()
    token = server.tokens["ops"]
    ids = [server.post(token, sleep_body(300)).json()["id"] for _ in range(3)]
    wait_running(server, token, ids)
    server.kill()
    if rig.served:  # a cloud sandbox keeps running (and billing) without its relay
        assert len(rig.alive()) == 3
    server.start()
    try:
        _eventually(
            # The restarted relay judges the killed one dead after BEATS_BEFORE_JUDGING
            # heartbeats of its own, then reaps within a sweep.
            lambda: rig.alive() == set(),
            REAP_INTERVAL_S * (BEATS_BEFORE_JUDGING + 1) + 10,
            "sandboxes outlived the relay",
        )
        # The sandboxes end before their runs are marked (a sweep terminates, then writes).
        _eventually(
            lambda: {server.get(token, f"/v1/runs/{i}").json()["state"] for i in ids} == {"lost"},
            REAP_INTERVAL_S * 2 + 5,
            "runs not marked lost",
        )
    finally:
        server.stop()


def test_sigterm_during_runs_cancels_and_terminates(rig: Rig, tmp_path: Path) -> None:
    server = relay_for(rig, tmp_path).start()
    token = server.tokens["ops"]
    ids = [server.post(token, sleep_body(300)).json()["id"] for _ in range(2)]
    wait_running(server, token, ids)
    server.stop()
    assert rig.alive() == set()
    server.start()
    try:
        runs = [server.get(token, f"/v1/runs/{i}").json() for i in ids]
        assert {(r["state"], r["error"]["code"]) for r in runs} == {("canceled", "shutting_down")}
    finally:
        server.stop()


def test_client_disconnect_mid_wait_does_not_leak(rig: Rig, tmp_path: Path) -> None:
    server = relay_for(rig, tmp_path).start()
    token = server.tokens["ops"]
    body = {"command": ["sh", "-c", "sleep 2; echo finished"], "timeout_s": 60}
    try:
        with pytest.raises(httpx.ReadTimeout):
            server.post(token, body, timeout=0.5, **{"Idempotency-Key": "gone"})
        again = server.post(token, body, **{"Idempotency-Key": "gone"})
        assert again.json()["state"] == "succeeded" and again.json()["stdout"] == "finished\n"
    finally:
        server.stop()


def test_timeout_terminates_the_sandbox(rig: Rig, tmp_path: Path) -> None:
    server = relay_for(rig, tmp_path).start()
    token = server.tokens["ops"]
    try:
        run = server.post(token, {"command": ["sh", "-c", "echo begun; sleep 300"], "timeout_s": 2})
        assert run.json()["state"] == "timed_out" and run.json()["stdout"] == "begun\n"
        assert rig.alive() == set()
    finally:
        server.stop()


def final_run(server: RelayProcess, token: str, answer: httpx.Response) -> dict[str, Any]:
    run_id = answer.json().get("id") or answer.json()["error"]["run_id"]
    return server.wait_final(token, run_id)


def test_create_hang_times_out_and_nothing_survives(fake_rig: Rig, tmp_path: Path) -> None:
    server = relay_for(fake_rig, tmp_path, create_timeout_s=2).start()
    token = server.tokens["ops"]
    fake_rig.faults.create_hang = True
    try:
        answer = server.post(token, {"command": ["echo", "x"]})
        assert answer.status_code == 504
        run = final_run(server, token, answer)
        assert (run["state"], run["error"]["code"]) == ("error", "provider_timeout")
    finally:
        fake_rig.faults.create_hang = False
        server.stop()


def test_create_fails_after_allocating_is_reaped(fake_rig: Rig, tmp_path: Path) -> None:
    server = relay_for(fake_rig, tmp_path).start()
    token = server.tokens["ops"]
    fake_rig.faults.create_allocates_then_fails = True
    try:
        answer = server.post(token, {"command": ["echo", "x"]})
        assert answer.status_code in (502, 503)
        run = final_run(server, token, answer)
        assert run["state"] == "error" and run["error"]["code"].startswith("provider_")
    finally:
        fake_rig.faults.create_allocates_then_fails = False
        server.stop()


def test_terminate_fails_three_times_then_the_reaper_succeeds(
    fake_rig: Rig, tmp_path: Path
) -> None:
    server = relay_for(fake_rig, tmp_path).start()
    token = server.tokens["ops"]
    try:
        fake_rig.faults.terminate_failures = 3
        run = server.post(token, {"command": ["echo", "kept"]}).json()
        assert run["state"] == "succeeded" and run["stdout"] == "kept\n"
        _eventually(lambda: fake_rig.alive() == set(), 20, "the reaper never terminated it")
        _eventually(
            lambda: server.get(None, "/readyz").json()["status"] == "ok",
            10,
            "readyz stayed degraded",
        )
    finally:
        fake_rig.faults.terminate_failures = 0
        server.stop()


def test_sandbox_disappearing_mid_run_is_sandbox_lost(fake_rig: Rig, tmp_path: Path) -> None:
    server = relay_for(fake_rig, tmp_path).start()
    token = server.tokens["ops"]
    fake_rig.faults.vanish_after_s = 1.0
    try:
        answer = server.post(token, {"command": ["sleep", "30"], "timeout_s": 60})
        run = final_run(server, token, answer)
        assert (run["state"], run["error"]["code"]) == ("error", "sandbox_lost")
        assert answer.status_code == 502
    finally:
        fake_rig.faults.vanish_after_s = None
        server.stop()


def test_stream_cut_ends_in_a_final_state(fake_rig: Rig, tmp_path: Path) -> None:
    server = relay_for(fake_rig, tmp_path).start()
    token = server.tokens["ops"]
    fake_rig.faults.cut_stream = True
    try:
        answer = server.post(token, {"command": ["sh", "-c", "echo a; sleep 1; echo b"]})
        run = final_run(server, token, answer)
        assert run["state"] in FINAL
        if run["state"] == "succeeded":  # an SDK that resumes must not lose or repeat output
            assert run["stdout"] == "a\nb\n"
    finally:
        fake_rig.faults.cut_stream = False
        server.stop()


def test_a_startup_with_many_orphans_serves_at_once(tmp_path: Path) -> None:
    """40 orphaned sandboxes on the Vercel fake: the restarted relay answers ``/healthz``
    while its startup sweep ends them, several at a time."""
    with RIGS["vercel"].started(tmp_path) as rig:
        # One token starts all 40: its fair share of the slots is all of them here.
        server = relay_for(rig, tmp_path, max_concurrent=64, token_share=1.0)
        server.start()
        token = server.tokens["ops"]
        ids = [server.post(token, sleep_body(300)).json()["id"] for _ in range(40)]
        wait_running(server, token, ids)
        server.kill()
        assert len(rig.alive()) == 40
        started = time.monotonic()
        server.start()
        try:
            serving_after = time.monotonic() - started
            assert len(rig.alive()) > 0, "the sweep ended before serving: nothing measured"
            _eventually(lambda: rig.alive() == set(), 30, "orphans outlived the sweep")
            swept_after = time.monotonic() - started
            # One at a time took ~0.2 s each on this fake (8 s for 40).
            assert swept_after - serving_after < 4, (serving_after, swept_after)
            states = {server.get(token, f"/v1/runs/{i}").json()["state"] for i in ids}
            assert states == {"lost"}
        finally:
            server.stop()
