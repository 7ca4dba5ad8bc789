"""The Vercel provider through the real ``vercel-sandbox`` SDK, against the protocol fake.

Every test ends with zero sandboxes running in the fake's ledger (autouse fixture).
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderUnavailable,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    OutputSink,
    Resources,
    SandboxSpec,
)
from relay.providers.lifecycle import TIMEOUT_MARGIN_S
from relay.providers.vercel import VercelProvider, network_policy_for, vcpus_for
from relay.settings import Settings
from testing.fakes.vercel import BAD_KEY, BODY_MARKER, FakeVercel, jail, running_fake
from testing.relay_server import SECRET_CANARY, RelayProcess
from testing.rigs.vercel import PROJECT, TEAM, TOKEN, settings_for


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVercel]:
    with running_fake() as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left_running(fake: FakeVercel) -> Iterator[None]:
    fake.reset()
    yield
    fake.reset()
    alive = fake.ledger.alive()
    for name in alive:  # don't let one failure cascade into the next test
        fake.call("destroy", name)
    assert alive == set(), f"sandboxes left running: {alive}"


@pytest.fixture
async def provider(fake: FakeVercel) -> AsyncIterator[VercelProvider]:
    vercel = VercelProvider(settings_for(fake))
    yield vercel
    await vercel.aclose()


def spec(run_id: str = "run_test1", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "test", "timeout_s": 20.0}
    values.update(fields)
    return SandboxSpec(**values)  # type: ignore[arg-type]


def created(fake: FakeVercel, sandbox_id: str) -> dict[str, object]:
    entry = fake.ledger.create_of(sandbox_id)
    assert entry is not None
    return entry


async def run(
    box: object, argv: list[str], *, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> tuple[int | None, OutputSink]:
    sink = OutputSink(10_000)
    result = await box.exec(  # type: ignore[attr-defined]
        argv, stdin=stdin, env=env or {}, workdir=None, timeout_s=20.0, output=sink
    )
    return result.exit_code, sink


# --- the happy path and the create request -------------------------------------------


async def test_runs_a_command_with_files_env_and_stdin(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    job = spec(image="python:3.12")
    async with provider.sandbox(job) as box:
        await box.upload({"data.txt": b"from a file\n", "/tmp/abs.txt": b"absolute\n"})
        script = 'cat data.txt "$1"; echo "$GREETING $EXTRA"; pwd; cat; exit 3'
        argv = ["sh", "-c", script, "sh", "/tmp/abs.txt"]
        code, sink = await run(box, argv, stdin=b"piped\n", env={"GREETING": "hello", "EXTRA": "x"})
        entry = created(fake, box.id)
    assert code == 3
    lines = sink.text("stdout").splitlines()
    assert lines[:4] == ["from a file", "absolute", "hello x", lines[3]]
    assert lines[3].endswith("/workspace") and lines[4] == "piped"
    assert entry["lifetime_s"] == job.lifetime_s == 50
    assert entry["tags"] == {TAG_CLUSTER: "test", TAG_RUN: "run_test1"}
    assert entry["network_policy"] == {"mode": "deny-all"}
    assert entry["resources"] == {"vcpus": 2}
    assert entry["image"] == "python:3.12"
    assert entry["env_names"] == []  # a job's env goes with its command, never at create
    assert entry["persistent"] is False
    assert entry["project_id"] == PROJECT and entry["team_id"] == TEAM
    commands = [c for c in fake.ledger.commands if c["sandbox"] == box.id]
    assert commands[0]["name"] == "mkdir" and commands[0]["sudo"] is True
    assert commands[-1]["args"] == argv[1:]  # argv as a list: no shell on our side
    assert commands[-1]["cwd"] == "/workspace"
    assert commands[-1]["timeout_ms"] == (20 + TIMEOUT_MARGIN_S) * 1000  # a second line only
    assert box.id in fake.ledger.destroys and box.id in fake.ledger.stops


async def test_stderr_and_output_cap(provider: VercelProvider) -> None:
    async with provider.sandbox(spec()) as box:
        sink = OutputSink(100)
        argv = ["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' a; echo oops >&2"]
        result = await box.exec(argv, stdin=None, env={}, workdir="sub", timeout_s=10, output=sink)
    assert result.exit_code == 0
    assert sink.output("stdout") == b"a" * 100 and sink.truncated("stdout")
    assert sink.text("stderr") == "oops\n" and not sink.truncated("stderr")


async def cancel_on_first_output(
    scope: anyio.CancelScope, first: anyio.Event, cancelled: list[float]
) -> None:
    await first.wait()
    await anyio.sleep(0.3)  # the command is still running: it sleeps for 30 s
    cancelled.append(time.monotonic())
    scope.cancel()


async def test_output_streams_and_the_deadline_cancels_promptly(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    first, cancelled = anyio.Event(), list[float]()
    sink = OutputSink(1000, listener=lambda _stream, _data: first.set())
    with anyio.fail_after(20):
        async with provider.sandbox(spec()) as box:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_first_output, group.cancel_scope, first, cancelled)
                await box.exec(
                    ["sh", "-c", "echo first; sleep 30; echo never"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=30,
                    output=sink,
                )
            returned = time.monotonic()
    assert returned - cancelled[0] < 1.0  # the exec reacted to cancellation promptly
    assert sink.text("stdout") == "first\n"  # it arrived while the command still ran
    assert fake.ledger.alive() == set()  # the context exit killed it


async def test_provider_lifetime_ends_a_sandbox_the_relay_forgot(provider: VercelProvider) -> None:
    job = spec(timeout_s=0.5, grace_s=1.0)  # lifetime 2 s, and no relay deadline below
    with pytest.raises(SandboxLost):
        async with provider.sandbox(job) as box:
            await run(box, ["sleep", "30"])


async def test_a_workdir_the_user_owns_needs_no_root(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    async with provider.sandbox(spec()) as box:
        sink = OutputSink(1000)
        result = await box.exec(
            ["pwd"], stdin=None, env={}, workdir="/vercel/sandbox/app", timeout_s=10, output=sink
        )
        names = [c["name"] for c in fake.ledger.commands if c["sandbox"] == box.id]
    assert result.exit_code == 0 and sink.text("stdout").endswith("/vercel/sandbox/app\n")
    assert names == ["pwd"]  # the directory came from the filesystem API, not a sudo mkdir


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_cancelling_the_whole_run_still_terminates_and_kills(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    """A client disconnect cancels the run's whole scope mid-command: the exit is shielded."""
    ids: list[str] = []
    first, cancelled = anyio.Event(), list[float]()
    sink = OutputSink(1000, listener=lambda _stream, _data: first.set())
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_on_first_output, group.cancel_scope, first, cancelled)
            async with provider.sandbox(spec()) as box:
                ids.append(box.id)
                argv = ["sh", "-c", "sleep 30 & echo up; sleep 30"]
                await box.exec(argv, stdin=None, env={}, workdir=None, timeout_s=30, output=sink)
    assert cancelled and ids[0] in fake.ledger.destroys and fake.ledger.alive() == set()
    pids = [c["pid"] for c in fake.ledger.commands if c["sandbox"] == ids[0]]
    assert pids and all(process_gone(pid) for pid in pids)  # a client timeout *is* a kill


async def test_concurrent_runs_all_end(fake: FakeVercel, provider: VercelProvider) -> None:
    results: dict[int, str] = {}

    async def one(index: int) -> None:
        async with provider.sandbox(spec(run_id=f"run_many{index}")) as box:
            code, sink = await run(box, ["sh", "-c", f"sleep 0.2; echo {index}"])
            assert code == 0
            results[index] = sink.text("stdout")

    async with anyio.create_task_group() as group:
        for index in range(6):
            group.start_soon(one, index)
    assert results == {index: f"{index}\n" for index in range(6)}
    assert len({entry["name"] for entry in fake.ledger.created}) == len(fake.ledger.created)


# --- mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "wire"),
    [
        ((), {"mode": "deny-all"}),
        (("*",), {"mode": "allow-all"}),
        (("pypi.org", "*.github.com"), {"allow": {"pypi.org": [], "*.github.com": []}}),
        (
            ("api.example.com", "10.0.0.0/8"),
            {"allow": {"api.example.com": []}, "subnets": {"allow": ["10.0.0.0/8"]}},
        ),
    ],
)
async def test_egress_becomes_a_network_policy(
    fake: FakeVercel, provider: VercelProvider, hosts: tuple[str, ...], wire: object
) -> None:
    async with provider.sandbox(spec(egress=Egress(hosts))) as box:
        assert created(fake, box.id)["network_policy"] == wire


@pytest.mark.parametrize("hosts", [("pypi.org:443",), ("*", "pypi.org"), ("http://x.org",)])
async def test_egress_vercel_cannot_express_is_refused_before_create(
    fake: FakeVercel, provider: VercelProvider, hosts: tuple[str, ...]
) -> None:
    before = len(fake.ledger.created)
    with pytest.raises(EgressUnsupported):
        provider.check(spec(egress=Egress(hosts)))  # the planner's call, once
    assert len(fake.ledger.created) == before


@pytest.mark.parametrize(
    ("cpu", "memory_mb", "vcpus"),
    [(0.5, 512, 2), (1, 4096, 2), (3, 1024, 4), (2, 9000, 6), (8, 16384, 8)],
)
def test_size_rounds_up_to_a_vercel_size(cpu: float, memory_mb: int, vcpus: int) -> None:
    assert vcpus_for(cpu, memory_mb) == vcpus


async def test_sizes_vercel_cannot_give_are_refused(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    before = len(fake.ledger.created)
    for resources in (Resources(cpu=16), Resources(cpu=2, memory_mb=32768)):
        with pytest.raises(SizeUnsupported):
            provider.check(spec(resources=resources))
    with pytest.raises(ValidationFailed):
        provider.check(spec(pip=("requests",)))
    assert len(fake.ledger.created) == before


async def test_resources_reach_the_create_request(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    async with provider.sandbox(spec(resources=Resources(cpu=3, memory_mb=2048))) as box:
        assert created(fake, box.id)["resources"] == {"vcpus": 4}


def test_network_policy_mapping_is_pure() -> None:
    assert network_policy_for(()).mode == "deny-all"
    assert network_policy_for(("*",)).mode == "allow-all"


async def test_the_token_is_not_in_the_providers_repr(provider: VercelProvider) -> None:
    assert TOKEN not in repr(vars(provider))


def test_the_fake_kills_its_processes_when_it_stops() -> None:
    async def start_and_abandon(fake: FakeVercel) -> None:
        vercel = VercelProvider(settings_for(fake))
        with anyio.move_on_after(1.0):
            async with vercel.sandbox(spec()) as box:
                await fake_sandbox_runs(box)
        await vercel.aclose()

    async def fake_sandbox_runs(box: object) -> None:
        # Started, then the fake itself goes away under it (not the provider's exit).
        await run(box, ["sleep", "60"])

    with running_fake() as fake:
        fake.faults.terminate_failures = 100  # the provider can't clean up: the fake must
        anyio.run(start_and_abandon, fake)
        pids = [c["pid"] for c in fake.ledger.commands if c.get("pid")]
        assert fake.ledger.alive() and pids
    assert all(process_gone(pid) for pid in pids)


def test_missing_credentials_are_a_config_error() -> None:
    with pytest.raises(ConfigError):
        VercelProvider(Settings(_env_file=None, vercel_token="t"))  # type: ignore[call-arg]


CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)"


@pytest.mark.skipif(jail.bwrap() is None, reason="the fake enforces deny-all only with bwrap")
@pytest.mark.parametrize(("hosts", "reachable"), [((), False), (("*",), True)])
async def test_no_egress_means_no_network_in_the_fake(
    fake: FakeVercel, provider: VercelProvider, hosts: tuple[str, ...], reachable: bool
) -> None:
    port = fake.url.rsplit(":", 1)[1]
    async with provider.sandbox(spec(egress=Egress(hosts))) as box:
        code, _ = await run(box, ["python3", "-c", CONNECT, port])
    assert (code == 0) is reachable


async def test_the_fake_without_bubblewrap_maps_paths(
    provider: VercelProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jail, "bwrap", lambda: None)
    async with provider.sandbox(spec()) as box:
        await box.upload({"in.txt": b"mapped\n"})
        code, sink = await run(box, ["cat", "/workspace/in.txt"])
    assert (code, sink.text("stdout")) == (0, "mapped\n")


# --- credentials -----------------------------------------------------------------------


async def test_stray_vercel_environment_never_wins(
    fake: FakeVercel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERCEL_OIDC_TOKEN", "stray-oidc-token")
    monkeypatch.setenv("VERCEL_TOKEN", "stray-token")
    monkeypatch.setenv("VERCEL_TEAM_ID", "team_stray")
    monkeypatch.setenv("VERCEL_PROJECT_ID", "prj_stray")
    with fake.ledger.lock:
        fake.ledger.tokens.clear()
        fake.ledger.team_ids.clear()
    vercel = VercelProvider(settings_for(fake))
    try:
        async with vercel.sandbox(spec()) as box:
            await run(box, ["true"])
            assert created(fake, box.id)["project_id"] == PROJECT
        await vercel.list_owned()
    finally:
        await vercel.aclose()
    assert fake.ledger.tokens == {TOKEN}
    assert fake.ledger.team_ids == {TEAM}


# --- faults ----------------------------------------------------------------------------


def assert_no_leak(exc: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    texts = [str(exc), *(record.getMessage() for record in caplog.records)]
    for text in texts:
        assert BODY_MARKER not in text and "sk-should-never-leak" not in text
        assert TOKEN not in text and BAD_KEY not in text


# The faults every provider shares (5xx/429/401 on create, a bad key, an unreachable API,
# hanging and half-allocated creates, cut streams, vanished sandboxes, failed terminates)
# are in tests/contract/fault_suite.py; these are the ones only Vercel's API has.


@pytest.mark.parametrize(
    ("status", "error"),
    [(403, ProviderAuth), (400, ProviderError), (429, ProviderRateLimited)],
)
async def test_create_errors_map_to_relay_errors(
    fake: FakeVercel,
    provider: VercelProvider,
    caplog: pytest.LogCaptureFixture,
    status: int,
    error: type[ProviderError],
) -> None:
    fake.faults.create_status = status
    with pytest.raises(error) as raised:
        async with provider.sandbox(spec()):
            pytest.fail("no sandbox should be yielded")
    assert type(raised.value) is error
    if status == 429:
        assert raised.value.retry_after == 7  # Vercel's own Retry-After, passed on
    assert_no_leak(raised.value, caplog)


@pytest.mark.parametrize("header", ["inf", "nan", "-3", "Wed, 21 Oct 2026 07:28:00 GMT"])
async def test_a_retry_after_that_is_not_a_number_of_seconds_is_dropped(
    fake: FakeVercel, provider: VercelProvider, header: str
) -> None:
    fake.faults.create_status, fake.faults.retry_after_s = 429, header
    with pytest.raises(ProviderRateLimited) as raised:
        async with provider.sandbox(spec()):
            pytest.fail("no sandbox should be yielded")
    assert raised.value.retry_after is None  # the relay answers with its own default


async def test_a_create_cancelled_by_the_caller_destroys_it_by_name(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    fake.faults.create_hang = True  # the fake allocates, then never answers
    with anyio.move_on_after(0.5):
        async with provider.sandbox(spec()):
            pytest.fail("no sandbox should be yielded")
    assert fake.ledger.created  # it was allocated under the name the relay chose
    assert fake.ledger.existing() == set()  # destroyed, not merely stopped


async def test_a_session_stopped_mid_run_is_sandbox_lost(
    fake: FakeVercel, provider: VercelProvider, caplog: pytest.LogCaptureFixture
) -> None:
    fake.faults.stop_after_s = 0.7  # the sandbox still exists; its session has stopped
    with pytest.raises(SandboxLost) as raised:
        async with provider.sandbox(spec()) as box:
            await run(box, ["sh", "-c", "echo started; sleep 30"])
    assert_no_leak(raised.value, caplog)


async def test_one_failed_stop_is_covered_by_destroy(
    fake: FakeVercel, provider: VercelProvider
) -> None:
    async with provider.sandbox(spec()) as box:
        fake.faults.terminate_failures = 1
    assert box.id in fake.ledger.destroys


async def test_list_errors_are_mapped(fake: FakeVercel, provider: VercelProvider) -> None:
    fake.faults.list_status = 502
    with pytest.raises(ProviderUnavailable):
        await provider.list_owned()


# --- reaper support --------------------------------------------------------------------


async def test_list_owned_and_idempotent_terminate(fake: FakeVercel) -> None:
    ours = VercelProvider(settings_for(fake))
    theirs = VercelProvider(settings_for(fake, cluster="other"))
    try:
        async with ours.sandbox(spec(run_id="run_mine")) as mine:
            async with theirs.sandbox(SandboxSpec("run_theirs", "other", 10.0)) as other:
                owned = await ours.list_owned()
                assert [(r.sandbox_id, r.run_id) for r in owned] == [(mine.id, "run_mine")]
                assert owned[0].created_at is not None
                await ours.terminate(other.id)  # the reaper may end any id it is given
                await ours.terminate(other.id)  # twice is fine
            await ours.terminate(mine.id)
            with pytest.raises(SandboxLost):
                await run(mine, ["true"])
        await ours.terminate("relay-never-existed")
        assert await ours.list_owned() == []
    finally:
        await ours.aclose()
        await theirs.aclose()


# --- live --------------------------------------------------------------------------------

# Read before the autouse fixture in tests/conftest.py clears RELAY_* from the environment.
LIVE_SETTINGS = {
    key: os.environ.get(f"RELAY_VERCEL_{key.upper()}") for key in ("token", "team_id", "project_id")
}
LIVE = all(LIVE_SETTINGS.values())


@pytest.mark.live
@pytest.mark.skipif(
    not LIVE,
    reason="needs RELAY_VERCEL_TOKEN, RELAY_VERCEL_TEAM_ID and RELAY_VERCEL_PROJECT_ID",
)
async def test_live_tiny_contract() -> None:
    values = {f"vercel_{key}": value for key, value in LIVE_SETTINGS.items()}
    settings = Settings(_env_file=None, cluster="relay-live-test", **values)  # type: ignore[call-arg]
    vercel = VercelProvider(settings)
    try:
        job = spec(run_id="run_live", timeout_s=60.0, cluster="relay-live-test")
        async with vercel.sandbox(job) as box:
            await box.upload({"hello.txt": b"hi\n"})
            code, sink = await run(box, ["sh", "-c", "cat hello.txt; echo $X"], env={"X": "y"})
            assert (code, sink.text("stdout")) == (0, "hi\ny\n")
            assert box.id in {ref.sandbox_id for ref in await vercel.list_owned()}
        assert box.id not in {ref.sandbox_id for ref in await vercel.list_owned()}
    finally:
        await vercel.aclose()


# --- end to end: a real relay process with RELAY_PROVIDERS=vercel against the fake --------


@pytest.fixture(scope="module")
def vercel_relay(
    fake: FakeVercel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayProcess]:
    server = relay_on_fake(fake, tmp_path_factory.mktemp("vercel-relay"))
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log() and BODY_MARKER not in server.log()


def relay_on_fake(fake: FakeVercel, root: Path) -> RelayProcess:
    return RelayProcess(
        root,
        providers="vercel",
        vercel_base_url=fake.url,
        vercel_team_id=TEAM,
        vercel_project_id=PROJECT,
        max_wait_s=20,
    )


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_every_example_job_runs_on_vercel(fake: FakeVercel, vercel_relay: RelayProcess) -> None:
    token = vercel_relay.tokens["ops"]
    echo = vercel_relay.post(token, {"job": "echo", "params": {"message": "hi; $(id)"}}).json()
    assert (echo["state"], echo["stdout"], echo["provider"]) == (
        "succeeded",
        "hi; $(id)\n",
        "vercel",
    )
    assert fake.ledger.create_of(echo["sandbox_id"]) is not None

    snippet = "import json; print(json.load(open('params.json'))['label'])"
    python = vercel_relay.post(token, {"job": "python", "stdin": snippet}).json()
    assert (python["state"], python["stdout"]) == ("succeeded", "snippet\n"), python
    assert (fake.ledger.create_of(python["sandbox_id"]) or {}).get("network_policy") == {
        "mode": "deny-all"
    }

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        body = {"job": "http-status", "params": {"urls": [url]}}
        status = vercel_relay.post(token, body).json()
    finally:
        server.shutdown()
        server.server_close()
    assert (status["state"], status["stdout"]) == ("succeeded", f"200 {url}\n"), status
    assert (fake.ledger.create_of(status["sandbox_id"]) or {}).get("network_policy") == {
        "mode": "allow-all"
    }
    assert fake.ledger.tokens >= {SECRET_CANARY}  # RELAY_VERCEL_TOKEN, nothing else
    assert fake.ledger.alive() == set()


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_timeout_and_provider_faults(fake: FakeVercel, vercel_relay: RelayProcess) -> None:
    token = vercel_relay.tokens["ops"]
    slow = {"command": ["sh", "-c", "echo begun; sleep 60"], "timeout_s": 1}
    run = vercel_relay.post(token, slow).json()
    assert (run["state"], run["stdout"]) == ("timed_out", "begun\n"), run
    assert fake.ledger.alive() == set()

    echo = {"job": "echo", "params": {"message": "x"}}
    for fault, field, status, code in [
        ("create_status", 500, 503, "provider_unavailable"),
        ("create_status", 429, 503, "provider_rate_limited"),
        ("create_status", 401, 502, "provider_auth"),
        ("vanish_after_s", 0.8, 502, "sandbox_lost"),
    ]:
        fake.faults.reset()
        setattr(fake.faults, fault, field)
        request = echo if fault == "create_status" else {"command": ["sleep", "30"]}
        answer = vercel_relay.post(token, request)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (status, code), answer.text
        assert BODY_MARKER not in answer.text and SECRET_CANARY not in answer.text
        if code == "provider_rate_limited":
            assert int(answer.headers["retry-after"]) >= 1
        run = vercel_relay.get(token, f"/v1/runs/{error['run_id']}").json()
        assert (run["state"], run["error"]["code"]) == ("error", code), run
        assert fake.ledger.alive() == set()


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_a_rate_limited_run_passes_on_vercels_retry_after(
    fake: FakeVercel, vercel_relay: RelayProcess
) -> None:
    token = vercel_relay.tokens["ops"]
    echo = {"job": "echo", "params": {"message": "x"}}
    key = {"Idempotency-Key": "rate-limited-1"}
    fake.faults.create_status, fake.faults.retry_after_s = 429, 7
    answer = vercel_relay.post(token, echo, **key)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"]) == (503, "provider_rate_limited"), answer.text
    assert answer.headers["retry-after"] == "7"  # what Vercel said, not a guess of the relay's

    fake.faults.reset()  # a replay returns the recorded run; it does not try again
    replay = vercel_relay.post(token, echo, **key)
    assert (replay.status_code, replay.json()["error"]["run_id"]) == (503, error["run_id"])
    assert replay.headers["retry-after"] == "7"
    run = vercel_relay.get(token, f"/v1/runs/{error['run_id']}").json()
    assert run["error"] == {
        "code": "provider_rate_limited",
        "message": run["error"]["message"],
        "retry_after_s": 7.0,
    }
    assert fake.ledger.alive() == set()


@pytest.mark.slow  # a relay killed or restarted, then waited for (make check leaves it out)
def test_e2e_a_killed_relay_leaves_a_sandbox_the_next_one_reaps(
    fake: FakeVercel, tmp_path: Path
) -> None:
    first = relay_on_fake(fake, tmp_path / "relay")
    token = first.add_token("ops", command=True)
    first.start()
    try:
        answer = first.post(token, {"command": ["sleep", "60"], "wait": False})
        assert answer.status_code == 202
        run_id = answer.json()["id"]
        deadline = time.monotonic() + 20
        while not fake.ledger.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the command is running in the sandbox
    finally:
        first.kill()  # SIGKILL: no finally, no shielded exit, nothing
    orphans = fake.ledger.alive()
    assert len(orphans) == 1  # a crash leaves it running (it would, until its own lifetime)
    second = relay_on_fake(fake, tmp_path / "relay")
    second.tokens = first.tokens
    second.start()
    try:
        final = second.wait_final(token, run_id, timeout_s=30)
        assert final["state"] == "lost", final
        deadline = time.monotonic() + 20
        while fake.ledger.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.ledger.alive() == set()
        assert orphans <= set(fake.ledger.destroys)
    finally:
        second.stop()
