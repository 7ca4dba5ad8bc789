"""GET /metrics: the numbers move as real runs happen, and no label carries an id.

A real relay process runs real jobs in bubblewrap; the metrics text is parsed with
prometheus-client's own parser. The reaper's failure counters are driven in-process by a
provider whose terminate fails, since nothing local refuses to terminate.
"""

from __future__ import annotations

import asyncio
import platform
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from relay import __version__
from relay.auth import new_token
from relay.http.app import create_app
from relay.http.metrics import Metrics
from relay.providers.contract import Rate, SandboxRef
from relay.run_state import ACTIVE
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.store.database import Store
from relay.store.records import RunRecord
from testing.relay_server import RelayProcess
from testing.rows import run_row
from tests.conftest import make_settings

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(relay: RelayProcess) -> tuple[str, Samples]:
    answer = httpx.get(relay.url + "/metrics", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    return answer.text, parse(answer.text)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("metrics"),
        local_isolation="bwrap",
        max_wait_s=5,
        drain_s=1,
        cost_rates='{"local": {"vcpu_s": 1.0, "gib_s": 0.0}}',
        webhook_allow_http="true",
        webhook_allow_private="true",
        webhook_max_attempts=2,
        webhook_backoff_s=0.1,
        webhook_poll_s=0.1,
    )
    server.add_token("ops", command=True, webhook_secret="whsec-metrics-test")
    server.start()
    yield server
    server.stop()


@pytest.mark.slow  # needs a relay process: seconds
def test_runs_move_counters_and_histograms(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    _, before = scrape(relay)
    ok = relay.post(token, {"job": "echo", "params": {"message": "hi"}}).json()
    failed = relay.post(token, {"command": ["sh", "-c", "exit 3"]}).json()
    slow = relay.post(token, {"job": "sleep", "params": {"seconds": 30}, "timeout_s": 0.5})
    assert (ok["state"], failed["state"], slow.json()["state"]) == (
        "succeeded",
        "failed",
        "timed_out",
    )
    relay.get(token, f"/v1/runs/{ok['id']}")
    text, after = scrape(relay)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("relay_runs_total", job="echo", provider="local", state="succeeded") == 1
    assert grew("relay_runs_total", job="(command)", provider="local", state="failed") == 1
    assert grew("relay_runs_total", job="sleep", provider="local", state="timed_out") == 1
    assert grew("relay_run_duration_seconds_count", provider="local") == 3
    assert grew("relay_run_duration_seconds_sum", provider="local") >= 0.5  # the sleep
    assert grew("relay_sandbox_create_seconds_count", provider="local") == 3
    assert grew("relay_sandbox_create_seconds_bucket", provider="local", le="+Inf") == 3
    # cost_usd is measured sandbox seconds at 1 USD per vCPU-second here
    assert grew("relay_spend_usd_total", provider="local") >= 0.5
    post = {"method": "POST", "route": "/v1/runs", "status": "200"}
    assert grew("relay_http_requests_total", **post) == 3
    get = {"method": "GET", "route": "/v1/runs/{run_id}", "status": "200"}
    assert grew("relay_http_requests_total", **get) == 1
    assert grew("relay_http_request_duration_seconds_count", method="POST", route="/v1/runs") == 3
    assert value(after, "relay_runs_in_flight") == 0
    assert ok["id"] not in text and failed["id"] not in text and token not in text


@pytest.mark.slow  # needs a relay process: seconds
def test_labels_are_templates_never_raw_input(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    relay.get(token, "/v1/runs/run_0000deadbeef")
    httpx.get(relay.url + "/no/such/path-xyz", timeout=5)
    httpx.request("PROPFIND", relay.url + "/v1/jobs", timeout=5)
    relay.post(token, {"job": "no-such-job-q7"})
    text, samples = scrape(relay)
    for raw in ("run_0000deadbeef", "/no/such", "path-xyz", "PROPFIND", "no-such-job-q7"):
        assert raw not in text, raw
    assert value(samples, "relay_http_requests_total", **{
        "method": "GET", "route": "/v1/runs/{run_id}", "status": "404"
    }) >= 1  # fmt: skip
    assert value(samples, "relay_http_requests_total", **{
        "method": "GET", "route": "(unmatched)", "status": "404"
    }) >= 1  # fmt: skip
    assert value(samples, "relay_http_requests_total", **{
        "method": "other", "route": "/v1/jobs", "status": "405"
    }) >= 1  # fmt: skip


@pytest.mark.slow  # needs a relay process: seconds
def test_process_and_build_info_series(relay: RelayProcess) -> None:
    """The relay's own process (not the test's) and its build, on the app's registry."""
    _, samples = scrape(relay)
    build = {labels: v for (name, labels), v in samples.items() if name == "relay_build_info"}
    assert list(build.values()) == [1.0]
    labels = dict(next(iter(build)))
    assert labels["version"] == __version__ and labels["python"] == platform.python_version()
    assert value(samples, "process_resident_memory_bytes") > 1_000_000
    assert value(samples, "process_open_fds") > 0
    start = value(samples, "process_start_time_seconds")
    assert 0 < time.time() - start < 3600


@pytest.mark.slow  # needs a relay process: seconds
def test_in_flight_follows_a_running_run(relay: RelayProcess) -> None:
    token = relay.tokens["ops"]
    run = relay.post(token, {"job": "sleep", "params": {"seconds": 30}, "wait": False}).json()
    deadline = time.monotonic() + 10
    while value(scrape(relay)[1], "relay_runs_in_flight") < 1:
        assert time.monotonic() < deadline, "the run never showed as in flight"
        time.sleep(0.05)
    assert relay.delete(token, f"/v1/runs/{run['id']}").json()["state"] == "canceled"
    assert value(scrape(relay)[1], "relay_runs_in_flight") == 0
    _, samples = scrape(relay)
    assert value(samples, "relay_runs_total", job="sleep", provider="local", state="canceled") >= 1


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_reaper_terminations_after_a_crash(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "crash", local_isolation="bwrap", drain_s=1)
    token = server.add_token("ops")
    server.start()
    try:
        run = server.post(token, {"job": "sleep", "params": {"seconds": 60}, "wait": False}).json()
        deadline = time.monotonic() + 10
        while server.get(token, f"/v1/runs/{run['id']}").json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        server.start()  # the startup sweep finds the orphaned run and ends its sandbox
        deadline = time.monotonic() + 10
        while server.get(token, f"/v1/runs/{run['id']}").json()["state"] != "lost":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _, samples = scrape(server)
        assert value(samples, "relay_reaper_terminations_total", reason="run_orphaned") >= 1
        assert value(samples, "relay_reaper_failures_total") == 0
        assert server.get(token, f"/v1/runs/{run['id']}").json()["state"] == "lost"
    finally:
        server.stop()


def orphaned_run(run_id: str, **values: Any) -> RunRecord:
    """A running run's row owned by a replica that died (it never wrote its end)."""
    now = time.time()
    return run_row(
        run_id, job="sleep", timeout_s=60.0, started_at=now, deadline=now + 60,
        owner="a-replica-that-died", cost_usd=0.5, **values,
    )  # fmt: skip


def test_a_run_the_reaper_marks_lost_is_counted(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    new_token(settings.tokens_file, "ops")

    async def seed() -> None:
        store = await Store.open(settings.database_url)
        try:
            await store.admit_run(orphaned_run("run_orphan"))
        finally:
            await store.close()

    asyncio.run(seed())
    with TestClient(create_app(settings)) as client:  # the startup sweep reaps it
        deadline = time.monotonic() + 10
        samples = parse(client.get("/metrics").text)
        while not value(samples, "relay_runs_total", job="sleep", provider="local", state="lost"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
            samples = parse(client.get("/metrics").text)
    lost = {"job": "sleep", "provider": "local", "state": "lost"}
    assert value(samples, "relay_runs_total", **lost) == 1
    assert value(samples, "relay_spend_usd_total", provider="local") == 0.5


async def test_a_run_its_owner_finished_meanwhile_is_not_counted_again(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database_url)
    try:
        events = EventBus()
        service = RunService(settings, store, Catalog({}), {}, events=events)
        reaper = Reaper(
            store,
            {},
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=30,
            single_replica=False,
            beats_before_judging=0,
        )
        metrics = Metrics()
        metrics.attach(service, reaper, events, ["local"])
        await store.admit_run(orphaned_run("run_raced"))
        seen = await store.runs_in_states(ACTIVE)  # the sweep reads the run as running…
        await store.update_run("run_raced", state="succeeded")  # …then its owner ends it

        async def as_read(states: Any, *, owner: str | None = None) -> list[RunRecord]:
            return seen

        async def read_again(ids: Any) -> dict[str, RunRecord]:
            return {run.id: run for run in seen}  # the owner ends it after this read too

        store.runs_in_states = as_read  # type: ignore[method-assign]
        store.runs_by_id = read_again  # type: ignore[method-assign]
        report = await reaper.sweep()
        assert report.lost_runs == ["run_raced"]  # the sweep did try to mark it
        samples = parse(metrics.render().decode())
        assert value(samples, "relay_runs_total", job="sleep", provider="local", state="lost") == 0
        assert (await store.get_run("run_raced")).state == "succeeded"  # type: ignore[union-attr]
    finally:
        await store.close()


class StuckProvider:
    """Lists one sandbox of this cluster that no run owns, and cannot terminate it."""

    name: ClassVar[str] = "stuck"
    rate: ClassVar[Rate] = Rate(0.0, 0.0)

    async def list_owned(self) -> list[SandboxRef]:
        long_ago = datetime(2000, 1, 1, tzinfo=UTC)  # past any lifetime: the reaper ends it
        return [SandboxRef("sbx-stuck", "run_unknown", created_at=long_ago)]

    async def terminate(self, sandbox_id: str) -> None:
        raise ConnectionError("the provider is down")

    async def aclose(self) -> None:
        return None


async def test_reaper_failures_are_exposed(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    store = await Store.open(settings.database_url)
    try:
        providers: dict[str, Any] = {"stuck": StuckProvider()}
        service = RunService(settings, store, Catalog({}), providers)
        reaper = Reaper(
            store,
            providers,
            service.settings,
            holds=service.holds,
            instance_id=service.instance_id,
            events=service.events,
            grace_s=30,
            single_replica=True,
        )
        metrics = Metrics()
        metrics.attach(service, reaper, EventBus(), providers)
        await reaper.sweep()
        await reaper.sweep()
        samples = parse(metrics.render().decode())
        assert value(samples, "relay_reaper_failures_total") == 2
        assert value(samples, "relay_reaper_failing_sandboxes") == 1
        assert not any(name == "relay_reaper_terminations_total" for name, _ in samples)
        assert "sbx-stuck" not in metrics.render().decode()
    finally:
        await store.close()


def test_spend_and_webhooks_counters_and_separate_registries() -> None:
    first, second = Metrics(), Metrics()
    run = run_row("run_1", provider="e2b", state="succeeded", cost_usd=0.25)
    first.on_event(RunEvent("run_1", "finished", state="succeeded", run=run))
    first.on_event(RunEvent("run_1", "state", state="running"))  # only final runs count
    first.webhook_delivered("delivered")
    first.webhook_delivered("failed")
    samples = parse(first.render().decode())
    assert value(samples, "relay_spend_usd_total", provider="e2b") == 0.25
    assert value(samples, "relay_runs_total", job="echo", provider="e2b", state="succeeded") == 1
    assert value(samples, "relay_webhook_deliveries_total", outcome="delivered") == 1
    assert value(samples, "relay_webhook_deliveries_total", outcome="failed") == 1
    assert parse(second.render().decode()).get(
        ("relay_spend_usd_total", frozenset({("provider", "e2b")}))
    ) is None  # fmt: skip


def test_metrics_token_guards_the_endpoint(tmp_path: Path) -> None:
    secret = "metrics-secret-0b1c"
    settings = make_settings(tmp_path, metrics_token=secret)
    new_token(settings.tokens_file, "ops")
    client = TestClient(create_app(settings))
    missing = client.get("/metrics")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="relay"'
    wrong = client.get("/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and secret not in wrong.text
    assert wrong.headers["www-authenticate"] == 'Bearer realm="relay", error="invalid_token"'
    right = client.get("/metrics", headers={"Authorization": f"Bearer {secret}"})
    assert right.status_code == 200 and "relay_http_requests_total" in right.text
    assert secret not in right.text


@pytest.mark.slow  # needs a relay process: seconds
def test_webhook_deliveries_are_counted_by_outcome(relay: RelayProcess) -> None:
    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200 if self.path == "/ok" else 500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    token = relay.tokens["ops"]
    try:
        for path in ("/ok", "/down"):
            body = {"job": "echo", "params": {"message": "x"}, "callback_url": base + path}
            assert relay.post(token, body).status_code == 200
        deadline = time.monotonic() + 15
        while True:
            samples = scrape(relay)[1]
            counts = {
                outcome: value(samples, "relay_webhook_deliveries_total", outcome=outcome)
                for outcome in ("delivered", "retrying", "failed")
            }
            if counts == {"delivered": 1, "retrying": 1, "failed": 1}:
                break
            assert time.monotonic() < deadline, counts
            time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()
