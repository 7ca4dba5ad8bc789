"""End to end: a real relay process with ``RELAY_PROVIDERS=modal`` against the fake Modal.

Every example job runs through the real ``modal`` client; every injected fault ends in the
run state and error code a caller would expect; afterwards no sandbox is alive.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testing.fakes.modal import FakeModal, running_fake
from testing.relay_server import SECRET_CANARY, RelayProcess

pytestmark = pytest.mark.slow  # needs a relay process: seconds


@pytest.fixture(scope="module")
def fake_modal() -> Iterator[FakeModal]:
    with running_fake() as fake:
        yield fake


@pytest.fixture(scope="module")
def relay(
    tmp_path_factory: pytest.TempPathFactory, fake_modal: FakeModal
) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("relay-modal"),
        providers="modal",
        modal_server_url=fake_modal.url,
        modal_token_id="ak-e2e",
        modal_token_secret=SECRET_CANARY,
        modal_app="relay-e2e",
        create_timeout_s=2,
        reap_interval_s=1,
        max_wait_s=30,
        max_output_bytes=65536,
    )
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log()


@pytest.fixture(autouse=True)
def _no_sandbox_left(fake_modal: FakeModal) -> Iterator[None]:
    fake_modal.reset()
    yield
    fake_modal.reset()
    assert fake_modal.ledger.alive() == set(), "a sandbox was left running"


def ops(relay: RelayProcess) -> str:
    return relay.tokens["ops"]


def created_for(fake: FakeModal, run_id: str) -> dict[str, Any]:
    entries = [e for e in fake.ledger.created if e["tags"].get("relay-run") == run_id]
    assert len(entries) == 1
    return entries[0]


def test_echo_job(relay: RelayProcess, fake_modal: FakeModal) -> None:
    run = relay.post(ops(relay), {"job": "echo", "params": {"message": "hi modal"}}).json()
    assert run["state"] == "succeeded" and run["stdout"] == "hi modal\n"
    assert run["provider"] == "modal" and run["cost_usd"] > 0  # at Modal's list price
    entry = created_for(fake_modal, run["id"])
    assert entry["sandbox_id"] == run["sandbox_id"]
    tags = dict(entry["tags"])
    created = float(tags.pop("relay-created"))  # the reaper's age rule (Modal lists no time)
    assert tags == {"relay-cluster": "e2e", "relay-run": run["id"]}
    assert abs(created - time.time()) < 600
    assert entry["network"] == {"type": "BLOCKED", "cidrs": [], "domains": []}
    assert entry["lifetime"] == 10 + 30  # the job's timeout plus RELAY_GRACE_S
    assert run["sandbox_id"] in {sandbox_id for sandbox_id, _ in fake_modal.ledger.terminated}


def test_python_job_with_stdin_and_params_file(relay: RelayProcess, fake_modal: FakeModal) -> None:
    snippet = "import json, sys\nprint(json.load(open('params.json'))['label'], sys.argv[1:])\n"
    body = {"job": "python", "params": {"label": "from-e2e"}, "stdin": snippet}
    run = relay.post(ops(relay), body).json()
    assert run["state"] == "succeeded", run
    assert run["stdout"] == "from-e2e []\n"
    entry = created_for(fake_modal, run["id"])
    assert any("python:3.12-slim" in c for c in fake_modal.images_commands())
    assert entry["network"]["type"] == "BLOCKED"


@pytest.fixture
def local_site() -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_http_status_job_with_open_egress(
    relay: RelayProcess, fake_modal: FakeModal, local_site: str
) -> None:
    run = relay.post(ops(relay), {"job": "http-status", "params": {"urls": [local_site]}}).json()
    assert run["state"] == "succeeded", run
    assert run["stdout"] == f"200 {local_site}\n"
    assert created_for(fake_modal, run["id"])["network"]["type"] == "OPEN"


def test_timeout_ends_the_run_and_the_sandbox(relay: RelayProcess, fake_modal: FakeModal) -> None:
    body = {"job": "sleep", "params": {"seconds": 60}, "timeout_s": 1}
    started = time.monotonic()
    run = relay.post(ops(relay), body).json()
    assert run["state"] == "timed_out" and run["stdout"] == "sleeping\n"
    assert time.monotonic() - started < 10
    assert run["sandbox_id"] not in fake_modal.ledger.alive()


def test_host_allow_list_is_refused_before_any_sandbox(
    relay: RelayProcess, fake_modal: FakeModal
) -> None:
    before = len(fake_modal.ledger.created)
    answer = relay.post(ops(relay), {"command": ["true"], "egress": ["pypi.org"]})
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "egress_unsupported"
    assert len(fake_modal.ledger.created) == before


@pytest.mark.parametrize(
    ("fault", "value", "status", "code"),
    [
        ("create_status", 500, 503, "provider_unavailable"),
        ("create_status", 429, 503, "provider_rate_limited"),
        ("create_status", 401, 502, "provider_auth"),
        ("create_hang", True, 504, "provider_timeout"),
        ("create_allocates_then_fails", True, 503, "provider_unavailable"),
        ("vanish_after_s", 0.5, 502, "sandbox_lost"),
    ],
)
def test_faults_end_in_error_runs(
    relay: RelayProcess, fake_modal: FakeModal, fault: str, value: object, status: int, code: str
) -> None:
    setattr(fake_modal.faults, fault, value)
    answer = relay.post(ops(relay), {"job": "sleep", "params": {"seconds": 5}})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == code
    assert "fake" not in error["message"] and SECRET_CANARY not in answer.text
    run_id = answer.headers["location"].rsplit("/", 1)[-1]
    run = relay.get(ops(relay), f"/v1/runs/{run_id}").json()
    assert run["state"] == "error" and run["error"]["code"] == code
    if code == "provider_rate_limited":
        assert answer.headers["retry-after"]


def test_cut_output_stream_is_resumed(relay: RelayProcess, fake_modal: FakeModal) -> None:
    fake_modal.faults.cut_stream = True
    script = "for i in 1 2 3; do echo line $i; sleep 0.1; done"
    run = relay.post(ops(relay), {"command": ["sh", "-c", script]}).json()
    assert run["state"] == "succeeded"
    assert run["stdout"] == "line 1\nline 2\nline 3\n"


def test_failed_terminate_is_left_to_the_reaper(relay: RelayProcess, fake_modal: FakeModal) -> None:
    fake_modal.faults.terminate_failures = 1000
    run = relay.post(ops(relay), {"job": "echo", "params": {"message": "x"}}).json()
    assert run["state"] == "succeeded"  # the job ended; only the terminate failed
    assert run["sandbox_id"] in fake_modal.ledger.alive()
    fake_modal.reset()  # Modal recovers; the reaper (every second here) ends the sandbox
    deadline = time.monotonic() + 10
    while run["sandbox_id"] in fake_modal.ledger.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run["sandbox_id"] not in fake_modal.ledger.alive()


def test_the_job_never_sees_the_modal_token(relay: RelayProcess) -> None:
    run = relay.post(ops(relay), {"command": ["env"]}).json()
    assert run["state"] == "succeeded"
    assert SECRET_CANARY not in run["stdout"] and "MODAL_" not in run["stdout"]


def test_relay_log_names_no_token(relay: RelayProcess, tmp_path: Path) -> None:
    assert SECRET_CANARY not in relay.log()
    assert "ak-e2e" not in relay.log()
