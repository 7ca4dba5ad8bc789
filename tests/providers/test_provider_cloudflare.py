"""The Cloudflare provider (httpx, no SDK) against the fake of the relay's job Worker.

What the contract suites (tests/contract/test_cloudflare.py) do not say: auth fails closed on
the relay's side too (no URL or key, a key that would travel in clear, a Worker that answers
without its key), sizes and egress mapped and never widened, a cut event stream followed on
from the last event, output the Worker dropped flagged, a job that ended under its command.
Every test ends with no container alive in the fake's ledger (autouse fixture).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator

import pytest

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderAuth,
    SandboxLost,
    SizeUnsupported,
    ValidationFailed,
)
from relay.providers.cloudflare import (
    CloudflareProvider,
    egress_for,
    instance_type_for,
    job_id_for,
)
from relay.providers.contract import (
    TAG_CLUSTER,
    TAG_RUN,
    Egress,
    OutputSink,
    Resources,
    SandboxSpec,
)
from relay.runs.costs import CostModel
from relay.settings import Settings
from testing.fakes.cloudflare import KEY, FakeCloudflare, running_fake
from testing.rigs.cloudflare import CloudflareRig, settings_for

NO_ENV_FILE = {"_env_file": None}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCloudflare]:
    with running_fake() as server:
        yield server


@pytest.fixture(autouse=True)
def nothing_left_running(fake: FakeCloudflare) -> Iterator[None]:
    fake.reset()
    yield
    fake.reset()
    alive = fake.ledger.alive()
    for job_id in alive:  # don't let one failure cascade into the next test
        fake.call("cancel", job_id)
    assert alive == set(), f"containers left running: {alive}"


@pytest.fixture
async def cloudflare(fake: FakeCloudflare) -> AsyncIterator[CloudflareProvider]:
    provider = CloudflareProvider(settings_for(fake))
    yield provider
    await provider.aclose()


def spec(run_id: str = "run_cf", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "test", "timeout_s": 20.0}
    return SandboxSpec(**{**values, **fields})  # type: ignore[arg-type]


async def run(box: object, argv: list[str], sink: OutputSink, timeout_s: float = 20) -> int | None:
    result = await box.exec(  # type: ignore[attr-defined]
        argv, stdin=None, env={}, workdir=None, timeout_s=timeout_s, output=sink
    )
    return int(result.exit_code) if result.exit_code is not None else None


# --- auth fails closed on the relay's side too -----------------------------------------------


def test_the_provider_does_not_start_without_the_workers_url_and_key() -> None:
    for values in (
        {},
        {"cloudflare_url": "https://jobs.example.workers.dev"},
        {"cloudflare_key": KEY},
        {"cloudflare_url": "https://jobs.example.workers.dev", "cloudflare_key": ""},
    ):
        settings = Settings(**NO_ENV_FILE, providers=["cloudflare"], **values)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"RELAY_CLOUDFLARE_URL.*RELAY_CLOUDFLARE_KEY"):
            CloudflareProvider(settings)


@pytest.mark.parametrize(
    "url",
    ["http://jobs.example.workers.dev", "ftp://jobs.example", "https://user:pw@jobs.example", "x"],
)
def test_a_url_that_would_carry_the_key_in_clear_or_is_no_url_is_refused(url: str) -> None:
    settings = Settings(**NO_ENV_FILE, cloudflare_url=url, cloudflare_key=KEY)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="RELAY_CLOUDFLARE_URL"):
        CloudflareProvider(settings)


@pytest.mark.parametrize("url", ["https://jobs.example.workers.dev/", "http://127.0.0.1:8792"])
async def test_https_or_this_machine_is_taken(url: str) -> None:
    settings = Settings(**NO_ENV_FILE, cloudflare_url=url, cloudflare_key=KEY)  # type: ignore[arg-type]
    await CloudflareProvider(settings).aclose()


async def test_a_worker_that_answers_without_its_key_is_refused_before_anything_is_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cloudflare's Sandbox Bridge with its key unset answers anyone: the relay's provider
    asks once without the key, and refuses a Worker that answers."""
    with running_fake(key=None, open_auth=True) as open_worker:
        provider = CloudflareProvider(settings_for(open_worker))
        try:
            with pytest.raises(ProviderAuth, match="fails open"):
                async with provider.sandbox(spec()):
                    pytest.fail("no sandbox on a Worker that fails open")
            with pytest.raises(ProviderAuth):
                await provider.list_owned()
        finally:
            await provider.aclose()
        assert open_worker.ledger.created == []
    assert any("without its key" in record.getMessage() for record in caplog.records)


async def test_a_worker_whose_key_was_never_set_is_provider_auth() -> None:
    with running_fake(key=None) as unset:
        provider = CloudflareProvider(settings_for(unset))
        try:
            with pytest.raises(ProviderAuth):
                async with provider.sandbox(spec()):
                    pytest.fail("no sandbox on a Worker with no key")
        finally:
            await provider.aclose()
        assert unset.ledger.created == []


async def test_the_key_goes_in_the_authorization_header_after_one_call_without_it(
    fake: FakeCloudflare, cloudflare: CloudflareProvider
) -> None:
    before = len(fake.ledger.keys)
    async with cloudflare.sandbox(spec()) as box:
        assert await run(box, ["true"], OutputSink(10)) == 0
    shown = fake.ledger.keys[before:]
    assert shown[0] == "" and set(shown[1:]) == {KEY}
    assert CloudflareRig.keys["cloudflare_key"] == KEY  # the rig's copy of the fake's key


# --- sizes and egress ------------------------------------------------------------------------


def test_a_size_gets_the_smallest_instance_type_that_holds_it() -> None:
    assert instance_type_for(Resources(0.0625, 256, 1024)) == "lite"
    assert instance_type_for(Resources(1.0, 1024, 1024)) == "standard-2"  # the relay's small
    assert instance_type_for(Resources(2.0, 4096, 4096)) == "standard-3"  # medium
    assert instance_type_for(Resources(4.0, 8192, 8192)) == "standard-4"  # large
    for too_big in (Resources(8.0, 1024, 1024), Resources(4.0, 16384, 1024)):
        with pytest.raises(SizeUnsupported):
            instance_type_for(too_big)
        with pytest.raises(SizeUnsupported):
            CloudflareProvider.check(None, spec(resources=too_big))  # type: ignore[arg-type]


async def test_the_worker_is_sent_the_size_and_gives_its_instance_type(
    fake: FakeCloudflare, cloudflare: CloudflareProvider
) -> None:
    async with cloudflare.sandbox(spec(resources=Resources(2.0, 4096, 4096))) as box:
        assert fake.ledger.create_of(box.id)["instance_type"] == "standard-3"  # type: ignore[index]


async def test_a_size_only_an_undeployed_instance_type_holds_is_size_unsupported() -> None:
    with running_fake(deployed=("lite", "basic", "standard-1", "standard-2")) as small:
        provider = CloudflareProvider(settings_for(small))
        try:
            with pytest.raises(SizeUnsupported):
                async with provider.sandbox(spec(resources=Resources(4.0, 8192, 8192))):
                    pytest.fail("no sandbox of a size the Worker does not deploy")
        finally:
            await provider.aclose()
        assert small.ledger.created == []


def test_egress_is_mapped_and_never_widened() -> None:
    assert egress_for(()) == []
    assert egress_for(("*",)) == ["*"]
    assert egress_for(("API.example.com", "*.example.org", "93.184.216.34")) == [
        "api.example.com",
        "*.example.org",
        "93.184.216.34",
    ]
    for hosts in [("10.0.0.0/8",), ("2001:db8::1",), ("example.com:8443",), ("*", "a.com")]:
        with pytest.raises(EgressUnsupported) as refused:
            CloudflareProvider.check(None, spec(egress=Egress(hosts)))  # type: ignore[arg-type]
        assert refused.value.status == 422


async def test_an_allow_list_reaches_the_worker_as_given(
    fake: FakeCloudflare, cloudflare: CloudflareProvider
) -> None:
    hosts = ("api.example.com", "93.184.216.34")
    async with cloudflare.sandbox(spec(egress=Egress(hosts))) as box:
        assert fake.ledger.create_of(box.id)["egress"] == list(hosts)  # type: ignore[index]


def test_an_image_or_pip_packages_are_refused() -> None:
    for refused in (spec(image="python:3.12"), spec(pip=("requests",))):
        with pytest.raises(ValidationFailed):
            CloudflareProvider.check(None, refused)  # type: ignore[arg-type]


def test_job_ids_follow_the_workers_rule_and_differ_per_create() -> None:
    first, second = job_id_for(spec("run_ABC/x..")), job_id_for(spec("run_ABC/x.."))
    assert first.startswith("run_abc-x-") and first != second
    assert job_id_for(spec("___")).startswith("run-")


# --- the run ---------------------------------------------------------------------------------


async def test_the_container_gets_the_runs_lifetime_tags_and_files(
    fake: FakeCloudflare, cloudflare: CloudflareProvider
) -> None:
    async with cloudflare.sandbox(spec("run_files", timeout_s=42, grace_s=8)) as box:
        entry = fake.ledger.create_of(box.id)
        assert entry is not None and entry["command"] is False  # the two-step form
        assert fake.ledger.lifetime_of(box.id) == 50
        assert fake.ledger.tags_of(box.id) == {TAG_CLUSTER: "test", TAG_RUN: "run_files"}
        await box.upload({"/workspace/a/abs.txt": b"abs\n", "rel.txt": b"rel\n"})
        sink = OutputSink(100)
        assert await run(box, ["cat", "a/abs.txt", "rel.txt"], sink) == 0
        assert sink.text("stdout") == "abs\nrel\n"
        assert box.id in fake.ledger.alive()  # kept after its command, until the terminate
    assert fake.ledger.destroyed_by(box.id) == "delete"


async def test_files_outside_the_workspace_are_refused(cloudflare: CloudflareProvider) -> None:
    async with cloudflare.sandbox(spec()) as box:
        for path in ("/etc/passwd", "../escape", "/workspace"):
            with pytest.raises(ValidationFailed):
                await box.upload({path: b"x"})


async def test_output_reaches_the_sink_while_the_command_runs(
    cloudflare: CloudflareProvider,
) -> None:
    seen: list[bytes] = []
    printed = asyncio.Event()

    def listen(stream: str, data: bytes) -> None:
        seen.append(data)
        printed.set()

    sink = OutputSink(100, listen)
    async with cloudflare.sandbox(spec()) as box:
        running = asyncio.create_task(run(box, ["sh", "-c", "echo one; sleep 2; echo two"], sink))
        await asyncio.wait_for(printed.wait(), 10)
        assert seen == [b"one\n"] and not running.done()
        assert await running == 0
    assert b"".join(seen) == b"one\ntwo\n"


async def test_a_cut_stream_is_followed_on_from_the_last_event_without_repeats(
    fake: FakeCloudflare, cloudflare: CloudflareProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake.faults.cut_stream = True  # every stream closes after its first output line
    sink = OutputSink(1000)
    argv = ["sh", "-c", "for i in 1 2 3 4 5 6 7; do echo $i; sleep 0.1; done; exit 3"]
    async with cloudflare.sandbox(spec()) as box:
        assert await run(box, argv, sink) == 3
        # The fake makes an event of each read of the job's output: seven, or fewer where a
        # loaded machine let lines pile up between reads. Each stream is cut after one.
        events = len(fake.world.jobs[box.id].events)
    assert sink.text("stdout") == "1\n2\n3\n4\n5\n6\n7\n"
    followed = sum("following on" in record.getMessage() for record in caplog.records)
    assert events >= 2 and followed == events


async def test_output_the_worker_dropped_is_flagged_truncated() -> None:
    with running_fake(output_limit_bytes=1024) as small:
        provider = CloudflareProvider(settings_for(small))
        try:
            sink = OutputSink(1_000_000)
            async with provider.sandbox(spec()) as box:
                assert await run(box, ["sh", "-c", "head -c 5000 /dev/zero; echo e >&2"], sink) == 0
        finally:
            await provider.aclose()
    assert len(sink.output("stdout")) == 1024
    assert sink.truncated("stdout") and not sink.truncated("stderr")


async def test_a_job_deleted_or_past_its_deadline_under_its_command_is_sandbox_lost(
    fake: FakeCloudflare, cloudflare: CloudflareProvider
) -> None:
    async with cloudflare.sandbox(spec()) as box:
        fake.call("cancel", box.id)  # another relay's reaper, say
        with pytest.raises(SandboxLost):
            await run(box, ["true"], OutputSink(10))
    fake.faults.timeout_ignored = True
    with pytest.raises(SandboxLost, match="deadline"):
        async with cloudflare.sandbox(spec(timeout_s=0.3, grace_s=0.2)) as box:
            await run(box, ["sleep", "30"], OutputSink(10), timeout_s=30)
    assert fake.ledger.destroyed_by(box.id) == "alarm"


async def test_the_commands_own_timeout_is_its_exit_code(cloudflare: CloudflareProvider) -> None:
    sink = OutputSink(1000)
    async with cloudflare.sandbox(spec()) as box:
        # The Worker's timeout is the run's plus TIMEOUT_MARGIN_S (2 s): the second line.
        assert await run(box, ["sleep", "30"], sink, timeout_s=0.5) == 124
    assert sink.text("stderr").startswith("Command timed out after 2500 ms")


def test_the_rate_is_cloudflares_list_price_and_can_be_overridden() -> None:
    providers = {"cloudflare": CloudflareProvider}
    listed = CostModel(providers)  # type: ignore[arg-type]
    assert listed.cost("cloudflare", 1.0, 1024, 3600) == pytest.approx(0.072 + 0.009)
    overridden = CostModel(providers, {"cloudflare": {"vcpu_s": 0.0}})  # type: ignore[arg-type]
    assert overridden.cost("cloudflare", 1.0, 1024, 3600) == pytest.approx(0.009)


# --- live ------------------------------------------------------------------------------------

# Read before the autouse fixture in tests/conftest.py clears RELAY_* from the environment.
LIVE_URL = os.environ.get("RELAY_CLOUDFLARE_URL")
LIVE_KEY = os.environ.get("RELAY_CLOUDFLARE_KEY")


@pytest.mark.live
@pytest.mark.skipif(
    not (LIVE_URL and LIVE_KEY),
    reason="needs RELAY_CLOUDFLARE_URL and RELAY_CLOUDFLARE_KEY (a deployed deploy/cloudflare)",
)
async def test_live_worker_runs_a_command_and_destroys_its_container() -> None:
    settings = Settings(
        **NO_ENV_FILE,  # type: ignore[arg-type]
        cluster="relay-live-test",
        cloudflare_url=LIVE_URL,
        cloudflare_key=LIVE_KEY,
        create_timeout_s=120,
    )
    provider = CloudflareProvider(settings)
    try:
        job = spec("run_live", cluster="relay-live-test", timeout_s=120.0)
        async with provider.sandbox(job) as box:
            await box.upload({"hello.txt": b"hi\n"})
            sink = OutputSink(1000)
            result = await box.exec(
                ["sh", "-c", "cat hello.txt; echo $X >&2"],
                stdin=None,
                env={"X": "y"},
                workdir=None,
                timeout_s=60,
                output=sink,
            )
            assert (result.exit_code, sink.text("stdout"), sink.text("stderr")) == (
                0,
                "hi\n",
                "y\n",
            )
            assert box.id in {ref.sandbox_id for ref in await provider.list_owned()}
        assert box.id not in {ref.sandbox_id for ref in await provider.list_owned()}
    finally:
        await provider.aclose()
