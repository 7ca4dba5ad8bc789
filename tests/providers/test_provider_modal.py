"""The Modal provider through the real ``modal`` client against the protocol-level fake.

Every test runs its own fake (it starts in milliseconds) and ends by checking the fake's
ledger: no sandbox may be left alive, whatever the test did.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from types import SimpleNamespace

import anyio
import modal as modal_sdk
import psutil
import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as sr
from modal_proto.api_grpc import ModalClientStub
from modal_proto.task_command_router_grpc import TaskCommandRouterStub

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderError,
    ProviderTimeout,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    OutputSink,
    Provider,
    Resources,
    SandboxSpec,
)
from relay.providers.lifecycle import TIMEOUT_MARGIN_S
from relay.providers.modal import TAG_CREATED, ModalProvider
from relay.settings import Settings
from testing.fakes.modal import FakeModal, running_fake
from testing.rigs.modal import settings_for


@pytest.fixture(autouse=True)
def fake() -> Iterator[FakeModal]:
    """A fresh fake per test; afterwards its ledger must show no sandbox alive."""
    with running_fake() as running:
        yield running
        running.reset()
        assert running.ledger.alive() == set(), "a sandbox was left running"


@pytest.fixture
async def provider(fake: FakeModal) -> AsyncIterator[ModalProvider]:
    provider = ModalProvider(settings_for(fake, create_timeout_s=5.0))
    yield provider
    await provider.aclose()


def spec(**overrides: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": "run_1", "cluster": "test", "timeout_s": 20.0}
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


async def run(
    provider: ModalProvider,
    argv: list[str],
    *,
    sandbox_spec: SandboxSpec | None = None,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    files: dict[str, bytes] | None = None,
    timeout_s: float = 20.0,
) -> tuple[int | None, OutputSink, str]:
    output = OutputSink(limit=1 << 20)
    async with provider.sandbox(sandbox_spec or spec()) as sandbox:
        if files:
            await sandbox.upload(files)
        result = await sandbox.exec(
            argv, stdin=stdin, env=env or {}, workdir=None, timeout_s=timeout_s, output=output
        )
    return result.exit_code, output, sandbox.id


async def process_gone(pid: int) -> bool:
    for _ in range(50):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        await anyio.sleep(0.05)
    return False


def test_provider_satisfies_protocol(fake: FakeModal) -> None:
    assert isinstance(ModalProvider(settings_for(fake)), Provider)


async def test_run_streams_output_files_stdin_and_env(
    fake: FakeModal, provider: ModalProvider
) -> None:
    code, output, sandbox_id = await run(
        provider,
        ["sh", "-c", 'cat data/in.txt; read line; echo "$line $GREETING"; echo oops >&2; exit 3'],
        stdin=b"from stdin\n",
        env={"GREETING": "hello"},
        files={"data/in.txt": b"a file\n"},
    )
    assert code == 3
    assert output.text("stdout") == "a file\nfrom stdin hello\n"
    assert output.text("stderr") == "oops\n"
    assert fake.ledger.terminated[-1][0] == sandbox_id


async def test_create_request_carries_lifetime_tags_network_resources(
    fake: FakeModal, provider: ModalProvider
) -> None:
    wanted = spec(timeout_s=42.0, grace_s=10.0, resources=Resources(cpu=2.0, memory_mb=2048))
    await run(provider, ["true"], sandbox_spec=wanted, env={"K": "v"})
    entry = fake.ledger.created[-1]
    assert entry["lifetime"] == 52 == wanted.lifetime_s
    assert entry["tags"].pop(TAG_CREATED).isdigit()
    assert entry["tags"] == {TAG_CLUSTER: "test", TAG_RUN: "run_1"}
    assert entry["network"]["type"] == "BLOCKED"
    assert entry["resources"] == {"milli_cpu": 2000, "memory_mb": 2048}
    assert entry["env"] == []  # a job's env goes with its command, never at create
    assert fake.ledger.execs[-1]["env"] == ["K"]  # an inline secret, never part of argv
    assert entry["entrypoint"] == []
    assert all("K=v" not in " ".join(ex["argv"]) for ex in fake.ledger.execs)


@pytest.mark.parametrize(
    ("hosts", "kind", "cidrs"),
    [
        (("*",), "OPEN", []),
        (("10.0.0.0/8", "192.0.2.7"), "ALLOWLIST", ["10.0.0.0/8", "192.0.2.7/32"]),
    ],
)
async def test_egress_mapping(
    fake: FakeModal, provider: ModalProvider, hosts: tuple[str, ...], kind: str, cidrs: list[str]
) -> None:
    await run(provider, ["true"], sandbox_spec=spec(egress=Egress(hosts)))
    assert fake.ledger.created[-1]["network"] == {"type": kind, "cidrs": cidrs, "domains": []}


async def test_host_names_refused_before_any_create(
    fake: FakeModal, provider: ModalProvider
) -> None:
    with pytest.raises(EgressUnsupported):
        provider.check(spec(egress=Egress(("pypi.org",))))  # the planner's call, once
    assert fake.ledger.created == []


def test_lifetime_beyond_a_day_is_refused(provider: ModalProvider) -> None:
    with pytest.raises(ValidationFailed):
        provider.check(spec(timeout_s=86_400.0))


@pytest.mark.parametrize("resources", [Resources(cpu=128), Resources(memory_mb=64)])
def test_sizes_modal_cannot_give(provider: ModalProvider, resources: Resources) -> None:
    with pytest.raises(SizeUnsupported):
        provider.check(spec(resources=resources))


async def test_image_from_registry_with_pip(fake: FakeModal, provider: ModalProvider) -> None:
    await run(provider, ["true"], sandbox_spec=spec(image="python:3.12-slim", pip=("rich",)))
    image = fake.ledger.created[-1]["image"]
    assert any("pip install" in command and "rich" in command for command in image["commands"])
    assert any("python:3.12-slim" in command for command in fake.images_commands())


async def test_job_sees_only_its_env(fake: FakeModal, provider: ModalProvider) -> None:
    _, output, _ = await run(provider, ["env"], env={"ONLY": "this"})
    names = {line.split("=", 1)[0] for line in output.text("stdout").splitlines()}
    assert "ONLY" in names
    assert not any(name.startswith(("MODAL_", "RELAY_")) for name in names)
    assert "as-test" not in output.text("stdout")
    assert not any(name.startswith("MODAL_") for name in os.environ)  # the relay set none


async def test_cancelled_exec_returns_promptly_and_terminates(
    fake: FakeModal, provider: ModalProvider
) -> None:
    output = OutputSink(limit=1024)
    started = time.monotonic()
    async with provider.sandbox(spec()) as sandbox:
        with anyio.move_on_after(0.5):
            await sandbox.exec(
                ["sh", "-c", "echo started; sleep 30"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=60,
                output=output,
            )
    assert time.monotonic() - started < 5
    assert output.text("stdout") == "started\n"
    assert fake.ledger.terminated[-1][0] == sandbox.id
    assert await process_gone(fake.ledger.execs[-1]["pid"])  # it died with its sandbox


async def test_command_timeout_is_a_second_line_of_defence(
    fake: FakeModal, provider: ModalProvider
) -> None:
    started = time.monotonic()
    code, _, _ = await run(provider, ["sleep", "30"], timeout_s=1)
    assert time.monotonic() - started < 8
    assert code in (None, 137)
    assert fake.ledger.execs[-1]["timeout_secs"] == 1 + TIMEOUT_MARGIN_S


async def test_a_sandbox_ended_by_its_own_lifetime_is_sandbox_lost(
    fake: FakeModal, provider: ModalProvider
) -> None:
    short = spec(timeout_s=0.5, grace_s=0.5)
    with pytest.raises(SandboxLost):  # Modal's own deadline killed it: not the job's exit
        await run(provider, ["sleep", "30"], sandbox_spec=short, timeout_s=20)
    assert fake.ledger.terminated == []  # killed by Modal, not by the relay


async def test_list_owned_and_idempotent_terminate(
    fake: FakeModal, provider: ModalProvider
) -> None:
    async with provider.sandbox(spec(run_id="run_list")) as sandbox:
        refs = await provider.list_owned()
        assert [(ref.sandbox_id, ref.run_id) for ref in refs] == [(sandbox.id, "run_list")]
        created = refs[0].created_at  # so the reaper's age rule applies to Modal too
        assert created is not None and abs((datetime.now(UTC) - created).total_seconds()) < 30
        await provider.terminate(sandbox.id)
        await provider.terminate(sandbox.id)
    await provider.terminate("sb-doesnotexist000000000000")
    assert await provider.list_owned() == []


async def test_other_clusters_are_not_listed(fake: FakeModal) -> None:
    mine = ModalProvider(settings_for(fake, cluster="mine"))
    theirs = ModalProvider(settings_for(fake, cluster="theirs"))
    try:
        async with theirs.sandbox(spec(cluster="theirs")):
            assert await mine.list_owned() == []
    finally:
        await mine.aclose()
        await theirs.aclose()


# -- faults ----------------------------------------------------------------------------------
# The faults every provider shares are in tests/contract/fault_suite.py; these are Modal's.


def test_missing_credentials_stop_the_start(fake: FakeModal) -> None:
    """As for every cloud provider, an unset key is a startup error, not a 502 per run."""
    for missing in ("modal_token_id", "modal_token_secret"):
        with pytest.raises(ConfigError, match="RELAY_MODAL_TOKEN_ID and RELAY_MODAL_TOKEN_SECRET"):
            ModalProvider(settings_for(fake, **{missing: None}))


async def test_one_terminate_failure_is_retried_by_the_client(
    fake: FakeModal, provider: ModalProvider
) -> None:
    fake.faults.terminate_failures = 1
    code, _, sandbox_id = await run(provider, ["true"])
    assert code == 0
    assert fake.ledger.terminated[-1][0] == sandbox_id


# -- live --------------------------------------------------------------------------------------


# Read at import: the suite's autouse fixture clears RELAY_* before each test body runs.
LIVE_TOKEN_ID = os.environ.get("RELAY_MODAL_TOKEN_ID")
LIVE_TOKEN_SECRET = os.environ.get("RELAY_MODAL_TOKEN_SECRET")
LIVE_APP = os.environ.get("RELAY_MODAL_APP", "relay-live-test")


@pytest.mark.live
@pytest.mark.skipif(
    not (LIVE_TOKEN_ID and LIVE_TOKEN_SECRET),
    reason="set RELAY_MODAL_TOKEN_ID and RELAY_MODAL_TOKEN_SECRET to run against real Modal",
)
async def test_live_modal_round_trip() -> None:
    settings = Settings(
        _env_file=None,
        providers=["modal"],
        cluster="relay-live-test",
        modal_token_id=LIVE_TOKEN_ID,
        modal_token_secret=LIVE_TOKEN_SECRET,
        modal_app=LIVE_APP,
        create_timeout_s=180.0,
    )  # type: ignore[call-arg]
    provider = ModalProvider(settings)
    live = spec(run_id=f"live_{int(time.time())}", cluster="relay-live-test", grace_s=30.0)
    try:
        code, output, sandbox_id = await run(
            provider,
            ["sh", "-c", "cat x.txt; read line; echo $HI $line"],
            sandbox_spec=live,
            stdin=b"from stdin\n",
            env={"HI": "there"},
            files={"x.txt": b"file\n"},
            timeout_s=60,
        )
        assert code == 0
        assert output.text("stdout") == "file\nthere from stdin\n"
        assert all(ref.sandbox_id != sandbox_id for ref in await provider.list_owned())
    finally:
        await provider.aclose()


# -- the fake itself, spoken to with the generated stubs --------------------------------------


@asynccontextmanager
async def raw_channel(fake: FakeModal) -> AsyncIterator[Channel]:
    host, port = fake.url.removeprefix("http://").split(":")
    channel = Channel(host, int(port))
    try:
        yield channel
    finally:
        channel.close()


async def test_fake_serves_exec_output_from_any_offset(
    fake: FakeModal, provider: ModalProvider
) -> None:
    _, output, sandbox_id = await run(provider, ["printf", "0123456789"])
    assert output.text("stdout") == "0123456789"
    record = fake.ledger.execs[-1]
    task_id = fake.sandboxes[sandbox_id].task_id
    request = sr.TaskExecStdioReadRequest(
        task_id=task_id,
        exec_id=record["exec_id"],
        offset=6,
        file_descriptor=sr.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT,
    )
    async with raw_channel(fake) as channel:
        stub = TaskCommandRouterStub(channel)
        answers = await stub.TaskExecStdioRead(request, metadata={"authorization": "Bearer x"})
    assert b"".join(answer.data for answer in answers) == b"6789"


async def test_fake_wait_is_a_real_long_poll(fake: FakeModal, provider: ModalProvider) -> None:
    metadata = {"x-modal-token-id": "ak-test", "x-modal-token-secret": "as-test"}
    async with provider.sandbox(spec()) as sandbox, raw_channel(fake) as channel:
        stub = ModalClientStub(channel)
        started = time.monotonic()
        request = api_pb2.SandboxWaitRequest(sandbox_id=sandbox.id, timeout=0.5)
        pending = await stub.SandboxWaitV2(request, metadata=metadata)
        assert time.monotonic() - started >= 0.45
        assert pending.result.status == api_pb2.GenericResult.GENERIC_STATUS_UNSPECIFIED
        await provider.terminate(sandbox.id)
        request = api_pb2.SandboxWaitRequest(sandbox_id=sandbox.id, timeout=5)
        done = await stub.SandboxWaitV2(request, metadata=metadata)
    assert done.result.status == api_pb2.GenericResult.GENERIC_STATUS_TERMINATED


async def test_fake_answers_unserved_methods_unimplemented(fake: FakeModal) -> None:
    async with raw_channel(fake) as channel:
        with pytest.raises(GRPCError) as caught:
            await ModalClientStub(channel).FunctionGet(api_pb2.FunctionGetRequest())
    assert caught.value.status == Status.UNIMPLEMENTED


async def test_concurrent_runs_share_one_client(fake: FakeModal, provider: ModalProvider) -> None:
    results: dict[int, str] = {}

    async def one(index: int) -> None:
        _, output, _ = await run(
            provider,
            ["sh", "-c", f"sleep 0.2; echo {index}"],
            sandbox_spec=spec(run_id=f"r{index}"),
        )
        results[index] = output.text("stdout")

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        for index in range(8):
            group.start_soon(one, index)
    assert results == {index: f"{index}\n" for index in range(8)}
    assert len(fake.ledger.terminated) == 8
    assert time.monotonic() - started < 5  # they ran side by side


async def test_terminate_survives_a_second_cancel(fake: FakeModal, provider: ModalProvider) -> None:
    """A server shutting down may cancel a run twice; the terminate must still finish."""
    entered = anyio.Event()

    async def runner() -> None:
        async with provider.sandbox(spec()) as sandbox:
            entered.set()
            await sandbox.exec(
                ["sleep", "60"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=60,
                output=OutputSink(9),
            )

    task = asyncio.create_task(runner())
    with anyio.fail_after(10):
        await entered.wait()
    await asyncio.sleep(0.3)
    fake.faults.terminate_failures = 2  # the client's retries make the terminate take ~0.3 s
    task.cancel()
    await asyncio.sleep(0.15)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.ledger.alive() == set()


async def test_terminate_kills_children_that_left_the_process_group(
    fake: FakeModal, provider: ModalProvider
) -> None:
    output = OutputSink(limit=1024)
    async with provider.sandbox(spec()) as sandbox:
        with anyio.move_on_after(1.0):
            await sandbox.exec(
                ["sh", "-c", "setsid sleep 60 & echo $!; wait"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=30,
                output=output,
            )
    child = int(output.text("stdout").strip())
    assert await process_gone(child)


async def test_upload_then_exec_makes_no_extra_directory_call(
    fake: FakeModal, provider: ModalProvider
) -> None:
    await run(provider, ["cat", "data/in.txt"], files={"data/in.txt": b"x"})
    commands = [ex["argv"][1] for ex in fake.ledger.execs if ex["argv"][0].startswith("/__modal")]
    assert commands == ['{"WriteFile": {"path": "/workspace/data/in.txt"}}']


async def test_a_client_that_never_closes_does_not_hold_the_create(
    fake: FakeModal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose first connection fails and whose close then never ends (a network
    that swallows packets): the create fails with the connection's error, not at its
    deadline, and never hangs on the close."""
    release = asyncio.Event()

    class HalfOpen:
        def __init__(self, *_: object) -> None:
            self.close = SimpleNamespace(aio=self._close)

        async def __aenter__(self) -> None:
            raise ConnectionResetError("the hello was cut")

        async def _close(self) -> None:
            await release.wait()

    monkeypatch.setattr(modal_sdk, "Client", HalfOpen)
    monkeypatch.setattr(ModalProvider, "terminate_timeout_s", 0.3)
    provider = ModalProvider(settings_for(fake, create_timeout_s=5.0))

    async def create() -> None:
        async with provider.sandbox(spec()):
            pass

    attempt = asyncio.create_task(create())
    started = time.monotonic()
    done, _ = await asyncio.wait({attempt}, timeout=3.0)
    release.set()  # lets the old code's unbounded close end, so the test fails, not hangs
    with pytest.raises(ProviderError) as raised:
        await attempt
    assert done, "the create waited for the half-open client's close"
    assert time.monotonic() - started < 3.0
    assert not isinstance(raised.value, ProviderTimeout), raised.value
