"""Daytona provider specifics, through the real ``daytona`` SDK against the protocol fake:
the create request (TTL, labels, network, size), the fake's own lifetimes, a sandbox killed
under a command, stray ``DAYTONA_*`` settings, and a real ``relay serve`` running the
README's example jobs with ``RELAY_PROVIDERS=daytona``. The shared contract is in
tests/contract/test_daytona.py."""

from __future__ import annotations

import asyncio
import http.server
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from relay.errors import ConfigError, EgressUnsupported, SandboxLost, SizeUnsupported
from relay.providers.contract import Egress, OutputSink, Resources, SandboxSpec
from relay.providers.daytona import DaytonaProvider, command_line, network_of, size_of
from relay.settings import Settings
from testing.fakes.daytona import BODY_MARKER, FakeDaytona, running_fake
from testing.relay_server import SECRET_CANARY, RelayProcess
from testing.rigs.daytona import KEY, settings_for
from tests.providers.test_probe import LINE, probe


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeDaytona]:
    with running_fake() as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left_running(fake: FakeDaytona) -> Iterator[None]:
    fake.reset()
    yield
    fake.reset()
    fake.world.minute_s = 60.0
    alive = fake.ledger.alive()
    for sandbox_id in alive:  # don't let one failure cascade into the next test
        fake.call("delete", sandbox_id)
    assert alive == set(), f"sandboxes left running: {alive}"


@pytest.fixture
async def provider(fake: FakeDaytona) -> AsyncIterator[DaytonaProvider]:
    daytona = DaytonaProvider(settings_for(fake))
    yield daytona
    await daytona.aclose()


def spec(run_id: str = "run_test1", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "test", "timeout_s": 20.0}
    values.update(fields)
    return SandboxSpec(**values)  # type: ignore[arg-type]


# --- mapping -------------------------------------------------------------------------------


def test_sizes_round_up_to_whole_vcpus_and_gib_or_are_refused() -> None:
    assert size_of(Resources(1.0, 1024, 1024)) is None  # the default sandbox has it
    assert size_of(Resources(2.0, 4096, 4096)) == (2, 4, 4)
    assert size_of(Resources(0.5, 1536, 1024)) == (1, 2, 3)
    with pytest.raises(SizeUnsupported):
        size_of(Resources(8.0, 1024, 1024))
    with pytest.raises(SizeUnsupported):
        size_of(Resources(1.0, 16384, 1024))


def test_egress_maps_to_block_all_or_allow_lists_and_never_widens() -> None:
    assert network_of(()) == {"network_block_all": True}
    assert network_of(("*",)) == {}
    assert network_of(("10.0.0.1", "PyPI.org")) == {
        "network_allow_list": "10.0.0.1/32",
        "domain_allow_list": "pypi.org",
    }
    for refused in [("*.github.com",), ("*", "pypi.org"), ("host:443",)]:
        with pytest.raises(EgressUnsupported):
            network_of(refused)
    with pytest.raises(EgressUnsupported):
        network_of(tuple(f"10.0.{i}.0/24" for i in range(6)))


def test_the_command_line_quotes_every_word_and_carries_no_value() -> None:
    line = command_line(["echo", "$(id); `x`"], "/workspace/a b", "/dev/null", 5)
    assert line == (
        "(mkdir -p -- '/workspace/a b' && cd -- '/workspace/a b' && exec env -- "
        "timeout -s KILL 7 echo '$(id); `x`' < /dev/null)"
    )
    line = command_line(["true"], "/w", "/s", 5, variables="/tmp/v f")
    assert line == (
        "(mkdir -p -- /w && cd -- /w && set -a && . '/tmp/v f' && set +a && "
        "command -p rm -f -- '/tmp/v f' && exec env -- timeout -s KILL 7 true < /s)"
    )


async def test_the_create_request_carries_lifetime_labels_network_and_size(
    fake: FakeDaytona, provider: DaytonaProvider
) -> None:
    job = spec(
        timeout_s=100,
        egress=Egress(("10.1.0.0/16",)),
        resources=Resources(2.0, 4096, 4096),
    )
    async with provider.sandbox(job) as box:
        entry = fake.ledger.create_of(box.id)
    assert entry is not None
    assert entry["ttl_minutes"] == 3  # 100 + 30 s of grace, up to whole minutes
    assert (entry["auto_stop_minutes"], entry["auto_delete_minutes"]) == (3, 0)
    assert (
        entry["labels"]["relay-cluster"] == "test" and entry["labels"]["relay-run"] == "run_test1"
    )
    assert entry["network_allow_list"] == "10.1.0.0/16" and not entry["network_block_all"]
    assert entry["resources"] == {"cpu": 2, "memory": 4, "disk": 4}
    assert "FROM python:3.12-slim" in entry["image"] and entry["target"] == "us"
    assert entry["env_names"] == []  # a job's env goes with its command, never at create


async def test_the_jobs_env_is_sent_once_and_never_on_a_command_line(
    fake: FakeDaytona, provider: DaytonaProvider
) -> None:
    """The env goes with the command, in an uploaded file, never at create; a session's
    command line (which the toolbox API shows to whoever holds the key) carries no value."""
    async with provider.sandbox(spec()) as box:
        sink = OutputSink(1000)
        await box.exec(
            ["sh", "-c", 'echo "$MODE $EXTRA $HOME"'],
            stdin=None,
            env={"MODE": "mode-value-9c", "EXTRA": "it's $(id)"},
            workdir=None,
            timeout_s=10,
            output=sink,
        )
        entry = fake.ledger.create_of(box.id)
        lines = [c["command"] for c in fake.ledger.commands if c["sandbox_id"] == box.id]
    assert sink.text("stdout") == "mode-value-9c it's $(id) /home/daytona\n", sink.text("stderr")
    assert entry is not None and entry["env_names"] == []  # never at create
    assert lines and not [line for line in lines if "mode-value-9c" in line or "$(id)" in line]


# --- lifetimes and loss ---------------------------------------------------------------------


async def test_the_fakes_ttl_ends_a_sandbox_the_relay_forgot(
    fake: FakeDaytona, provider: DaytonaProvider
) -> None:
    fake.world.minute_s = 0.1  # one TTL minute of the fake is 0.1 s
    box = await provider.create(spec(timeout_s=20, grace_s=10))  # ttl 1 minute
    assert box.id in fake.ledger.alive()
    await asyncio.sleep(0.5)
    assert box.id not in fake.ledger.alive()
    assert box.id in {sandbox_id for sandbox_id, _ in fake.ledger.expired}
    assert await provider.gone(box.id)
    await provider.terminate(box.id)  # already gone: success


async def test_a_sandbox_killed_under_a_running_command_is_sandbox_lost(
    fake: FakeDaytona, provider: DaytonaProvider
) -> None:
    sink = OutputSink(100)
    started = time.monotonic()
    with pytest.raises(SandboxLost):
        async with provider.sandbox(spec()) as box:
            asyncio.get_running_loop().call_later(0.5, fake.call, "vanish", box.id)
            await box.exec(
                ["sh", "-c", "echo started; sleep 30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=30,
                output=sink,
            )
    assert time.monotonic() - started < 10
    assert sink.text("stdout") == "started\n"


async def test_stray_daytona_settings_never_win(
    fake: FakeDaytona, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DAYTONA_API_KEY", "stray-env-key")
    monkeypatch.setenv("DAYTONA_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("DAYTONA_TARGET", "eu")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("DAYTONA_API_KEY=stray-dotenv-key\nDAYTONA_TARGET=eu\n")
    fake.ledger.keys.clear()
    daytona = DaytonaProvider(settings_for(fake))
    try:
        async with daytona.sandbox(spec()) as box:
            entry = fake.ledger.create_of(box.id)
    finally:
        await daytona.aclose()
    assert entry is not None and entry["target"] == "us"
    assert fake.ledger.keys == {KEY}


def test_missing_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="RELAY_DAYTONA_API_KEY"):
        DaytonaProvider(Settings(_env_file=None, providers=["daytona"]))  # type: ignore[call-arg]


# --- live ----------------------------------------------------------------------------------

# Read before the autouse fixture in tests/conftest.py clears RELAY_* from the environment.
LIVE_KEY = os.environ.get("RELAY_DAYTONA_API_KEY")
LIVE_URL = os.environ.get("RELAY_DAYTONA_API_URL")


@pytest.mark.live
@pytest.mark.skipif(not LIVE_KEY, reason="needs RELAY_DAYTONA_API_KEY")
async def test_live_tiny_contract() -> None:
    values: dict[str, object] = {"daytona_api_key": LIVE_KEY}
    if LIVE_URL:
        values["daytona_api_url"] = LIVE_URL
    settings = Settings(_env_file=None, cluster="relay-live-test", **values)  # type: ignore[arg-type]
    daytona = DaytonaProvider(settings)
    try:
        job = spec(run_id="run_live", timeout_s=60.0, cluster="relay-live-test")
        async with daytona.sandbox(job) as box:
            await box.upload({"hello.txt": b"hi\n"})
            sink = OutputSink(1000)
            result = await box.exec(
                ["sh", "-c", "cat hello.txt; echo $X >&2"],
                stdin=None,
                env={"X": "y"},
                workdir=None,
                timeout_s=30,
                output=sink,
            )
            assert (result.exit_code, sink.text("stdout"), sink.text("stderr")) == (
                0,
                "hi\n",
                "y\n",
            )
            assert box.id in {ref.sandbox_id for ref in await daytona.list_owned()}
        assert box.id not in {ref.sandbox_id for ref in await daytona.list_owned()}
    finally:
        await daytona.aclose()


# --- end to end: a real relay process with RELAY_PROVIDERS=daytona against the fake -------


@pytest.fixture(scope="module")
def daytona_relay(
    fake: FakeDaytona, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("daytona-relay"),
        providers="daytona",
        daytona_api_url=fake.api_url,
        daytona_api_key=SECRET_CANARY,
        max_wait_s=20,
    )
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log() and BODY_MARKER not in server.log()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_every_example_job_runs_on_daytona(
    fake: FakeDaytona, daytona_relay: RelayProcess
) -> None:
    token = daytona_relay.tokens["ops"]
    echo = daytona_relay.post(token, {"job": "echo", "params": {"message": "hi; $(id)"}}).json()
    assert (echo["state"], echo["stdout"], echo["provider"]) == (
        "succeeded",
        "hi; $(id)\n",
        "daytona",
    )
    assert fake.ledger.create_of(echo["sandbox_id"]) is not None

    snippet = "import json; print(json.load(open('params.json'))['label'])"
    python = daytona_relay.post(token, {"job": "python", "stdin": snippet}).json()
    assert (python["state"], python["stdout"]) == ("succeeded", "snippet\n"), python
    assert (fake.ledger.create_of(python["sandbox_id"]) or {}).get("network_block_all") is True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        status = daytona_relay.post(token, {"job": "http-status", "params": {"urls": [url]}}).json()
    finally:
        server.shutdown()
        server.server_close()
    assert (status["state"], status["stdout"]) == ("succeeded", f"200 {url}\n"), status
    assert not (fake.ledger.create_of(status["sandbox_id"]) or {}).get("network_block_all")
    assert fake.ledger.keys >= {SECRET_CANARY}
    assert fake.ledger.alive() == set()


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_timeout_and_provider_faults(fake: FakeDaytona, daytona_relay: RelayProcess) -> None:
    token = daytona_relay.tokens["ops"]
    slow = {"command": ["sh", "-c", "echo begun; sleep 60"], "timeout_s": 1}
    run = daytona_relay.post(token, slow).json()
    assert (run["state"], run["stdout"]) == ("timed_out", "begun\n"), run
    assert fake.ledger.alive() == set()

    echo = {"job": "echo", "params": {"message": "x"}}
    for fault, value, status, code in [
        ("create_status", 500, 503, "provider_unavailable"),
        ("create_status", 429, 503, "provider_rate_limited"),
        ("create_status", 403, 502, "provider_auth"),
        ("vanish_after_s", 0.8, 502, "sandbox_lost"),
    ]:
        fake.faults.reset()
        setattr(fake.faults, fault, value)
        request = echo if fault == "create_status" else {"command": ["sleep", "30"]}
        answer = daytona_relay.post(token, request)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (status, code), answer.text
        assert BODY_MARKER not in answer.text and SECRET_CANARY not in answer.text
        if code == "provider_rate_limited":
            assert int(answer.headers["retry-after"]) >= 1


@pytest.mark.slow  # runs the relay CLI in a subprocess: seconds
def test_relay_probe_daytona_against_the_fake(fake: FakeDaytona, tmp_path: Path) -> None:
    """``relay probe daytona``, configured only by RELAY_DAYTONA_* in its environment."""
    done = probe(
        "daytona",
        tmp_path,
        RELAY_DAYTONA_API_URL=fake.api_url,
        RELAY_DAYTONA_API_KEY=SECRET_CANARY,
    )
    # (stderr may warn that RELAY_DAYTONA_* "is not a relay setting": the CLI's check of
    # variable names predates per-provider settings and warns for every provider's.)
    assert done.returncode == 0 and "error" not in done.stderr, done.stderr
    [line] = done.stdout.splitlines()
    match = LINE.match(line)
    assert match and match["provider"] == "daytona" and match["verdict"] == "ok", line
    assert SECRET_CANARY not in line
    assert fake.ledger.alive() == set()
