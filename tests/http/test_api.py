"""End to end through a real relay process and the local provider (bubblewrap)."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from testing.host import sleep_marker
from testing.relay_server import SECRET_CANARY, RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds

MAX_BODY = 200_000


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("relay"),
        max_wait_s=3,
        max_output_bytes=65536,
        max_body_bytes=MAX_BODY,
        local_isolation="bwrap",
    )
    server.add_token("ops", command=True)
    server.add_token("echo-only", jobs=["echo"])
    server.add_token("other")
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log()


def ops(relay: RelayProcess) -> str:
    return relay.tokens["ops"]


def test_health_and_readiness(relay: RelayProcess) -> None:
    assert relay.get(None, "/healthz").json() == {"status": "ok"}
    ready = relay.get(None, "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ok"


def test_echo_job_succeeds_with_the_text(relay: RelayProcess) -> None:
    answer = relay.post(relay.tokens["echo-only"], {"job": "echo", "params": {"message": "hi"}})
    assert answer.status_code == 200
    run = answer.json()
    assert run["state"] == "succeeded" and run["exit_code"] == 0 and run["stdout"] == "hi\n"
    assert run["provider"] == "local" and run["sandbox_id"]
    assert answer.headers["location"].endswith(f"/v1/runs/{run['id']}")
    assert run["timings"]["create_ms"] is not None and run["duration_ms"] is not None


def test_params_reach_the_job_as_data_only(relay: RelayProcess) -> None:
    params = {"name": "x; rm -rf / && $(id)", "tags": ["ab", "cd"], "flag": True}
    run = relay.post(ops(relay), {"job": "params", "params": params}).json()
    assert run["state"] == "succeeded", run
    assert run["stdout"].strip() == (
        '[["x; rm -rf / && $(id)", "--tags", "ab", "cd", "n=2"], "true", '
        '{"count": 2, "flag": true, "name": "x; rm -rf / && $(id)", "tags": ["ab", "cd"]}]'
    )


def test_non_zero_exit_is_a_200_with_failed_state(relay: RelayProcess) -> None:
    answer = relay.post(ops(relay), {"command": ["sh", "-c", "echo bad >&2; exit 7"]})
    assert answer.status_code == 200
    run = answer.json()
    assert (run["state"], run["exit_code"], run["stderr"]) == ("failed", 7, "bad\n")


def test_auth_errors(relay: RelayProcess) -> None:
    """Every 401 names the scheme to use (RFC 9110's challenge), and says the token was
    refused where one was sent (RFC 6750's ``invalid_token``), so a client knows to send or
    renew a bearer token; a missing or malformed one gets the bare challenge."""
    body = {"job": "echo", "params": {"message": "x"}}
    missing = relay.post(None, body)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="relay"'
    unknown = relay.post("rly_not-a-token", body)
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "unauthorized"
    assert unknown.headers["www-authenticate"] == 'Bearer realm="relay", error="invalid_token"'
    basic = httpx.post(
        relay.url + "/v1/runs", json=body, headers={"Authorization": f"Basic {ops(relay)}"}
    )
    assert basic.status_code == 401
    assert basic.headers["www-authenticate"] == 'Bearer realm="relay"'
    listed = relay.get(None, "/v1/runs")
    assert listed.status_code == 401 and listed.headers["www-authenticate"].startswith("Bearer ")


def test_scopes_are_enforced(relay: RelayProcess) -> None:
    job = relay.post(relay.tokens["echo-only"], {"job": "sleep", "params": {"seconds": 0}})
    assert job.status_code == 403 and job.json()["error"]["code"] == "forbidden"
    raw = relay.post(relay.tokens["other"], {"command": ["id"]})
    assert raw.status_code == 403
    jobs = relay.get(relay.tokens["echo-only"], "/v1/jobs").json()["jobs"]
    assert [job["name"] for job in jobs] == ["echo"]
    assert jobs[0]["params"][0]["name"] == "message"


def test_wait_false_answers_202_then_the_run_finishes(relay: RelayProcess) -> None:
    answer = relay.post(ops(relay), {"job": "sleep", "params": {"seconds": 1}, "wait": False})
    assert answer.status_code == 202
    run = answer.json()
    assert run["state"] in ("queued", "starting", "running")
    assert answer.headers["location"].endswith(run["id"])
    final = relay.wait_final(ops(relay), run["id"])
    assert final["state"] == "succeeded" and final["stdout"] == "sleeping\nwoke\n"


def test_a_wait_past_max_wait_turns_into_202(relay: RelayProcess) -> None:
    started = time.monotonic()
    answer = relay.post(ops(relay), {"job": "sleep", "params": {"seconds": 5}})
    assert answer.status_code == 202
    assert 2.5 < time.monotonic() - started < 5
    assert relay.wait_final(ops(relay), answer.json()["id"])["state"] == "succeeded"


def test_timeout_kills_everything_including_setsid_children(relay: RelayProcess) -> None:
    markers = [sleep_marker(seconds) for seconds in (347, 348, 349)]
    script = "setsid sleep {} & (sleep {} &) ; echo started; sleep {}".format(*markers)
    run = relay.post(ops(relay), {"command": ["sh", "-c", script], "timeout_s": 1}).json()
    assert run["state"] == "timed_out" and run["stdout"] == "started\n"
    time.sleep(0.5)
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"]
        and p.info["cmdline"][:1] == ["sleep"]
        and p.info["cmdline"][1:2] in ([marker] for marker in markers)
    ]
    assert leftovers == []


def test_job_cannot_see_the_relays_variables(relay: RelayProcess) -> None:
    run = relay.post(ops(relay), {"command": ["env"], "env": {"MINE": "1"}}).json()
    assert run["state"] == "succeeded"
    assert "MINE=1" in run["stdout"].splitlines()
    assert "RELAY_" not in run["stdout"] and SECRET_CANARY not in run["stdout"]


def test_job_cannot_read_the_relays_files(relay: RelayProcess) -> None:
    run = relay.post(ops(relay), {"command": ["cat", str(relay.tokens_file)]}).json()
    assert run["state"] == "failed" and "sha256" not in run["stdout"]


def test_no_egress_means_no_tcp_connection(relay: RelayProcess) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
    run = relay.post(ops(relay), {"command": ["python3", "-c", code], "egress": []}).json()
    thread.join()
    listener.close()
    assert run["state"] == "failed" and "connected" not in run["stdout"]
    assert accepted == []


def test_a_host_allow_list_is_refused_on_local(relay: RelayProcess) -> None:
    answer = relay.post(ops(relay), {"command": ["true"], "egress": ["example.com"]})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "egress_unsupported"


def test_output_is_capped_and_flagged(relay: RelayProcess) -> None:
    code = "import sys\nfor _ in range(160): sys.stdout.write('y' * 65536)\nprint('done', file=sys.stderr)"
    run = relay.post(ops(relay), {"command": ["python3", "-c", code]}).json()
    assert run["state"] == "succeeded"
    assert run["stdout"] == "y" * 65536 and run["stdout_truncated"] is True
    assert run["stderr"] == "done\n" and run["stderr_truncated"] is False


def test_same_idempotency_key_same_run_and_one_sandbox(relay: RelayProcess) -> None:
    body = {"command": ["sh", "-c", "sleep 1; echo once"], "wait": True}
    token = relay.add_token("idem", command=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: relay.post(token, body, **{"Idempotency-Key": "k1"}), range(8))
        )
    ids = {answer.json()["id"] for answer in answers}
    assert len(ids) == 1 and all(answer.status_code in (200, 202) for answer in answers)
    runs = relay.get(token, "/v1/runs").json()["runs"]
    assert len(runs) == 1
    assert relay.wait_final(token, ids.pop())["stdout"] == "once\n"
    conflict = relay.post(token, {"command": ["echo", "other"]}, **{"Idempotency-Key": "k1"})
    assert (
        conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_conflict"
    )


def test_a_disconnected_caller_does_not_stop_its_run(relay: RelayProcess) -> None:
    body = {"command": ["sh", "-c", "sleep 1.5; echo survived"]}
    with pytest.raises(httpx.ReadTimeout):
        relay.post(ops(relay), body, timeout=0.5, **{"Idempotency-Key": "disconnect-1"})
    time.sleep(2)
    again = relay.post(ops(relay), body, **{"Idempotency-Key": "disconnect-1"})
    assert again.status_code == 200 and again.json()["stdout"] == "survived\n"


def test_cancel_terminates_a_running_run(relay: RelayProcess) -> None:
    sleeping = ["sleep", sleep_marker(351)]
    run = relay.post(ops(relay), {"command": sleeping, "wait": False}).json()
    for _ in range(50):
        if relay.get(ops(relay), f"/v1/runs/{run['id']}").json()["state"] == "running":
            break
        time.sleep(0.1)
    canceled = relay.delete(ops(relay), f"/v1/runs/{run['id']}")
    assert canceled.status_code == 200 and canceled.json()["state"] == "canceled"
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == sleeping]
    again = relay.delete(ops(relay), f"/v1/runs/{run['id']}")
    assert again.status_code == 409 and again.json()["error"]["code"] == "run_finished"


def test_runs_are_private_to_their_token(relay: RelayProcess) -> None:
    run = relay.post(ops(relay), {"command": ["true"]}).json()
    other = relay.tokens["other"]
    assert relay.get(other, f"/v1/runs/{run['id']}").status_code == 404
    assert relay.delete(other, f"/v1/runs/{run['id']}").status_code == 404
    assert all(r["id"] != run["id"] for r in relay.get(other, "/v1/runs").json()["runs"])


def test_listing_pages_with_a_cursor(relay: RelayProcess) -> None:
    token = relay.add_token("pager", command=True)
    made = [relay.post(token, {"command": ["echo", str(i)]}).json()["id"] for i in range(5)]
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = relay.get(token, "/v1/runs", **params).json()
        seen += [run["id"] for run in page["runs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == list(reversed(made))
    failed = relay.get(token, "/v1/runs", state="failed").json()["runs"]
    assert failed == []


def test_unknown_routes_and_methods_answer_json(relay: RelayProcess) -> None:
    missing = relay.get(ops(relay), "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.put(relay.url + "/v1/runs", headers=relay.headers(ops(relay)))
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    unknown_run = relay.get(ops(relay), "/v1/runs/run_nope")
    assert unknown_run.status_code == 404


def test_request_id_is_echoed_or_made(relay: RelayProcess) -> None:
    answer = httpx.get(relay.url + "/healthz", headers={"X-Request-Id": "abc-123"})
    assert answer.headers["x-request-id"] == "abc-123"
    error = relay.post(None, {})
    assert error.json()["error"]["request_id"] == error.headers["x-request-id"]


def test_body_limit_at_its_edge(relay: RelayProcess) -> None:
    def body_of(size: int) -> bytes:
        head = b'{"command": ["true"], "files": {"f": "'
        tail = b'"}}'
        return head + b"a" * (size - len(head) - len(tail)) + tail

    at_limit = httpx.post(
        relay.url + "/v1/runs",
        content=body_of(MAX_BODY),
        headers=relay.headers(ops(relay)),
        timeout=30,
    )
    assert at_limit.status_code == 200, at_limit.text
    over = httpx.post(
        relay.url + "/v1/runs",
        content=body_of(MAX_BODY + 1),
        headers=relay.headers(ops(relay)),
        timeout=30,
    )
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        data = body_of(MAX_BODY + 1)
        for start in range(0, len(data), 16384):
            yield data[start : start + 16384]

    streamed = httpx.post(
        relay.url + "/v1/runs", content=chunks(), headers=relay.headers(ops(relay)), timeout=30
    )
    assert streamed.status_code == 413


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_runs_survive_a_restart(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "r")
    token = server.add_token("t", command=True)
    server.start()
    try:
        run = server.post(token, {"command": ["echo", "kept"]}).json()
    finally:
        server.stop()
    server.start()
    try:
        again = server.get(token, f"/v1/runs/{run['id']}").json()
        assert again["state"] == "succeeded" and again["stdout"] == "kept\n"
    finally:
        server.stop()


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_sigterm_drains_then_cancels(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "d", drain_s=2)
    token = server.add_token("t", command=True)
    server.start()
    quick = server.post(token, {"command": ["sh", "-c", "sleep 1; echo drained"], "wait": False})
    marker = sleep_marker(352)
    slow = server.post(token, {"command": ["sleep", marker], "wait": False})
    time.sleep(0.3)
    assert server.stop() == 0  # a clean shutdown

    def sleeping() -> list[object]:
        return [
            p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]
        ]

    for _ in range(30):  # the kernel may take a moment to reap a killed namespace
        if not sleeping():
            break
        time.sleep(0.1)
    assert not sleeping()
    server.start()
    try:
        done = server.get(token, f"/v1/runs/{quick.json()['id']}").json()
        assert done["state"] == "succeeded" and done["stdout"] == "drained\n"
        cut = server.get(token, f"/v1/runs/{slow.json()['id']}").json()
        assert cut["state"] == "canceled" and cut["error"]["code"] == "shutting_down"
    finally:
        server.stop()


def test_relay_refuses_to_start_without_tokens(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "n")
    with pytest.raises(RuntimeError, match="no token file"):
        server.start()
