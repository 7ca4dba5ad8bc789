"""The exe.dev provider through the real ``exedev`` SDK, against the protocol fake: what is
its own beyond the contract suites (names and tags, egress, sizes, the job's env on no
command line and in no log, stdin and output byte for byte, the create the SDK would wait
ten minutes for, token scopes) and a real relay process on it.

Every test ends with zero VMs left in the fake's ledger (autouse fixture).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import exedev
import httpx
import pytest

from relay.errors import (
    ConfigError,
    EgressUnsupported,
    ProviderAuth,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
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
from relay.providers.exedev.names import escaped, tags_for, tags_of, unescaped, vm_name
from relay.providers.exedev.provider import LIMITS, STREAM_READ_S, ExedevProvider, egress_of
from relay.providers.exedev.sandbox import INLINE_BYTES
from relay.settings import Settings
from testing.exedev_faults import killed_relay
from testing.fakes.exedev import BODY_MARKER, FakeExedev, running_fake
from testing.fakes.vercel.jail import bwrap
from testing.relay_server import SECRET_CANARY, RelayProcess
from testing.rigs.exedev import TOKEN, settings_for

VM_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9-]*$")


@pytest.fixture
def fake() -> Iterator[FakeExedev]:
    """A fresh fake each test (its ledger is the test's alone), left with no VM."""
    with running_fake() as server:
        yield server
        server.reset()
        alive = server.ledger.alive()
        assert alive == set(), f"VMs left behind: {alive}"


@pytest.fixture
async def provider(fake: FakeExedev) -> AsyncIterator[ExedevProvider]:
    exe = ExedevProvider(settings_for(fake))
    yield exe
    await exe.aclose()


def spec(run_id: str = "run_test1", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {"run_id": run_id, "cluster": "test", "timeout_s": 20.0}
    values.update(fields)
    return SandboxSpec(**values)  # type: ignore[arg-type]


async def run(
    box: object, argv: list[str], limit: int = 65536, **options: object
) -> tuple[int | None, OutputSink]:
    sink = OutputSink(limit, options.pop("listener", None))  # type: ignore[arg-type]
    given = {"stdin": None, "env": {}, "workdir": None, "timeout_s": 20.0} | options
    result = await box.exec(argv, output=sink, **given)  # type: ignore[attr-defined]
    return result.exit_code, sink


# --- the mapping ----------------------------------------------------------------------------


def test_names_are_exe_dev_names_made_from_the_run_alone() -> None:
    job = spec("run_ABC_0123456789xyz")
    name = vm_name(job)
    assert name.startswith("test-run-abc-01234") and VM_NAME.match(name)
    assert vm_name(job) == name != vm_name(spec("run_ABC_0123456789xyZ"))
    longest = vm_name(spec("run_" + "9" * 40, cluster="c" * 40))
    assert len(longest) <= 63 and VM_NAME.match(longest)
    # exe.dev is said to refuse names ending in -<digits>: a digit-only run id ends in letters.
    for run_id in ("run_123", "999", "pool_00", "probe_1234567890abcdef"):
        assert not re.search(r"-\d+$", vm_name(spec(run_id))), run_id


def test_tags_are_plain_words_that_read_back_exactly() -> None:
    for run_id in ("run_0193abc", "pool_x-y", "probe_Z", "run_ü ✓", "r--u_d"):
        assert unescaped(escaped(run_id)) == run_id
        assert re.fullmatch(r"[a-z0-9-]+", escaped(run_id)), run_id
    tags = tags_for(spec("run_tag_me", timeout_s=42, grace_s=10))
    assert tags[:3] == ["relay-cluster-test", "relay-run-run-utag-ume", "relay-lifetime-52"]
    assert re.fullmatch(r"relay-created-\d+", tags[3])
    assert all(re.fullmatch(r"[a-z0-9-]+", tag) for tag in tags)
    read = tags_of([*tags, "someone-elses", "relay-run-x-q"])  # -q: no escape of ours
    assert (read[TAG_CLUSTER], read[TAG_RUN]) == ("test", "run_tag_me")


def test_egress_is_all_or_integrations_and_never_a_host_list() -> None:
    assert egress_of(Egress(("*",))) == "all"
    assert egress_of(Egress(())) == "integrations"
    for hosts in (("pypi.org",), ("10.0.0.0/8",), ("*", "pypi.org")):
        with pytest.raises(EgressUnsupported) as refused:
            egress_of(Egress(hosts))
        assert (refused.value.status, refused.value.code) == (422, "egress_unsupported")


def test_sizes_beyond_the_sandbox_vm_and_pip_are_refused(fake: FakeExedev) -> None:
    exe = ExedevProvider(settings_for(fake))
    exe.check(spec(resources=Resources(cpu=2, memory_mb=4096, disk_mb=10240)))
    for size in (Resources(cpu=2.5), Resources(memory_mb=4097), Resources(disk_mb=10241)):
        with pytest.raises(SizeUnsupported):
            exe.check(spec(resources=size))
    with pytest.raises(ValidationFailed):
        exe.check(spec(pip=("requests",)))


def test_a_missing_token_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="RELAY_EXEDEV_TOKEN"):
        ExedevProvider(Settings(_env_file=None, providers=["exedev"]))  # type: ignore[call-arg]


def test_the_provider_says_it_has_no_hard_lifetime() -> None:
    assert LIMITS == {"hard_lifetime": False, "lifetime": "reaper"}
    assert ExedevProvider.limits is LIMITS


def test_the_rate_is_the_sandbox_vms_price() -> None:
    rate = ExedevProvider.rate
    per_hour = (2 * rate.vcpu_s + 4 * rate.gib_s) * 3600
    assert per_hour == pytest.approx(0.105)


# --- against the fake -----------------------------------------------------------------------


async def test_a_run_creates_a_named_tagged_vm_and_deletes_it_confirmed_by_a_listing(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    job = spec("run_named", egress=Egress(("*",)), image="ubuntu:24.04")
    async with provider.sandbox(job) as box:
        assert box.id == vm_name(job)
        status, sink = await run(box, ["echo", "hi"])
        assert (status, sink.text("stdout")) == (0, "hi\n")
    created = fake.ledger.create_of(box.id)
    assert created is not None
    assert created["tags"][:2] == ["relay-cluster-test", "relay-run-run-unamed"]
    assert (created["image"], created["egress"], created["by"]) == ("ubuntu:24.04", "all", TOKEN)
    assert created["env_names"] == []  # never `new --env`: a spec carries no env
    assert [entry["name"] for entry in fake.ledger.deleted] == [box.id]
    verbs = fake.ledger.verbs()
    assert verbs[verbs.index("rm") + 1] == "ls"  # the delete, confirmed by listing


@pytest.mark.skipif(bwrap() is None, reason="the fake enforces egress with bubblewrap")
async def test_no_egress_is_a_vm_restricted_to_integrations(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    interfaces = "awk -F: 'NR>2 {gsub(/ /, \"\", $1); print $1}' /proc/net/dev"
    async with provider.sandbox(spec("run_closed")) as box:
        status, sink = await run(box, ["sh", "-c", interfaces])
    assert (status, sink.text("stdout")) == (0, "lo\n")
    created = fake.ledger.create_of(box.id)
    assert created is not None and created["egress"] == "integrations"


async def test_the_jobs_env_joins_the_vms_environment_on_no_command_line(
    fake: FakeExedev, provider: ExedevProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """The variables travel in a file the job's wrapper reads and deletes: not the SDK's
    ``run(env=)``, whose ``export K=V`` stays in the login shell's argv for the whole run."""
    caplog.set_level(logging.DEBUG)
    value = "env-canary-77c1 with 'quotes' $(id) and\nlines"
    script = (
        'printf "%s|%s|%s\\n" "$SECRET_VALUE" "$HOME" "${PATH:+path}"; '
        "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'env-canary-7[7]c1'; "
        "ls /tmp/relay-run-*/ | grep -c '^env$'"
    )
    async with provider.sandbox(spec("run_env")) as box:
        status, sink = await run(box, ["sh", "-c", script], env={"SECRET_VALUE": value})
    home = "/home/exedev"
    assert status == 1, sink.text("stderr")  # grep -c found the value nowhere: 0 and exit 1
    assert sink.text("stdout") == f"{value}|{home}|path\n0\n0\n"
    assert not any("env-canary-77c1" in record.getMessage() for record in caplog.records)
    assert all("env-canary-77c1" not in command["command"] for command in fake.ledger.commands)


async def test_stdin_and_output_are_exact_bytes_small_or_large(
    provider: ExedevProvider,
) -> None:
    odd = b"a\r\nb\x00\xff\xfe no newline at the end"
    large = bytes(range(256)) * ((INLINE_BYTES * 2) // 256)  # written to the VM first
    async with provider.sandbox(spec("run_bytes")) as box:
        for given in (odd, large):
            status, sink = await run(box, ["sh", "-c", "cat; cat >&2 < /dev/null"], stdin=given)
            assert (status, sink.output("stdout")) == (0, given)
        status, sink = await run(box, ["sh", "-c", "printf 'x\\r\\n\\377'; printf 'e' >&2"])
        assert (sink.output("stdout"), sink.output("stderr")) == (b"x\r\n\xff", b"e")


async def test_files_small_and_large_land_under_the_workdir_or_where_they_say(
    provider: ExedevProvider,
) -> None:
    large = os.urandom(INLINE_BYTES * 2)  # does not compress: uploaded in parts first
    files = {"a/small.txt": b"small\n", "big.bin": large, "/tmp/abs.txt": b"abs\n"}
    async with provider.sandbox(spec("run_files")) as box:
        await box.upload(files)
        argv = ["sh", "-c", "cat small.txt /tmp/abs.txt; wc -c < ../big.bin; pwd"]
        status, sink = await run(box, argv, workdir="a")
    assert (status, sink.text("stdout")) == (0, f"small\nabs\n{len(large)}\n/workspace/a\n")


async def test_output_arrives_live_as_the_stream_does(provider: ExedevProvider) -> None:
    seen: list[tuple[float, bytes]] = []
    async with provider.sandbox(spec("run_live_output")) as box:
        started = time.monotonic()
        status, sink = await run(
            box,
            ["sh", "-c", "echo first; sleep 1.5; echo second"],
            listener=lambda stream, chunk: seen.append((time.monotonic() - started, chunk)),
        )
        ended = time.monotonic() - started
    assert (status, sink.text("stdout")) == (0, "first\nsecond\n")
    assert seen[0][1] == b"first\n" and seen[0][0] < ended - 1.0  # while it slept


async def test_a_quiet_job_is_followed_as_long_as_exe_devs_heartbeats_keep_it_alive(
    provider: ExedevProvider,
) -> None:
    """A command may print nothing for minutes; exe.dev sends a blank line about every 30 s.
    The follow's read may wait 75 s (two missed heartbeats), not httpx's default 5 s."""
    reads: list[float] = []

    async def note(response: httpx.Response) -> None:
        if b"relay-follow" in response.request.content:
            reads.append(response.request.extensions["timeout"]["read"])

    provider._http.event_hooks["response"].append(note)
    async with provider.sandbox(spec("run_quiet")) as box:
        status, _ = await run(box, ["true"])
    assert (status, reads) == (0, [STREAM_READ_S])


async def test_output_past_the_cap_is_not_read_to_its_end(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    async with provider.sandbox(spec("run_capped")) as box:
        argv = ["sh", "-c", "head -c 3000000 /dev/zero; echo done >&2; exit 3"]
        status, sink = await run(box, argv, limit=1000)
    assert (status, sink.output("stdout"), sink.text("stderr")) == (3, b"\0" * 1000, "done\n")
    assert sink.truncated("stdout")
    follows = [c["command"] for c in fake.ledger.commands if "relay-follow" in c["command"]]
    assert len(follows) >= 2 and " end " in follows[-1]  # followed on from the end


async def test_the_in_vm_timeout_kills_a_job_whose_relay_let_go(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    """No provider-side lifetime: a job whose relay stopped following it (its request
    dropped, as when the relay is killed) is ended by the in-VM ``timeout -s KILL``."""
    async with provider.sandbox(spec("run_forgotten")) as box:
        with anyio.move_on_after(0.5):
            await run(box, ["sleep", "30"], timeout_s=0.1)
        [folder] = (fake.world.vms[box.id].root / "tmp").glob("relay-run-*")
        started = time.monotonic()
        while not (folder / "exit").exists() and time.monotonic() - started < 8:
            await asyncio.sleep(0.05)
        assert (folder / "exit").read_text() == "137\n"  # SIGKILL at 0.1 s + the margin
        assert time.monotonic() - started < 4


async def test_a_create_that_never_answers_is_a_timeout_and_its_vm_is_deleted_by_name(
    fake: FakeExedev,
) -> None:
    """The SDK would wait 600 s for the answer and shield a cancelled ``new()``: the relay's
    transport ends the wait within the create timeout, and the VM the create made is deleted
    by the name the relay gave it, with no listing (here one would hang too)."""
    exe = ExedevProvider(settings_for(fake, create_timeout_s=1.0))
    fake.faults.create_hang = True
    fake.faults.list_hang = True
    started = time.monotonic()
    try:
        with pytest.raises(ProviderTimeout):
            async with exe.sandbox(spec("run_hung")):
                pytest.fail("no sandbox should be yielded")
        elapsed = time.monotonic() - started
        # The sweep goes on beside serving once the create's bound is out (the caller has its
        # answer): its delete is waited for, not assumed done by then (a loaded machine).
        async with asyncio.timeout(10):
            while not fake.ledger.deleted:
                await asyncio.sleep(0.02)
    finally:
        fake.faults.list_hang = False
        await exe.aclose()
    assert elapsed < 5  # the create timeout (and a bounded sweep), not the SDK's 600 s
    name = vm_name(spec("run_hung"))
    assert [entry["name"] for entry in fake.ledger.created] == [name]
    assert fake.ledger.alive() == set()
    assert [(entry["name"], entry["by"]) for entry in fake.ledger.deleted] == [(name, TOKEN)]


async def test_the_sdk_client_never_waits_longer_than_the_relays_bound(
    fake: FakeExedev,
) -> None:
    exe = ExedevProvider(settings_for(fake, create_timeout_s=1.0))
    fake.faults.create_hang = True
    started = time.monotonic()
    try:
        with pytest.raises(exedev.NetworkError):  # no cancel: the SDK's own call ends
            await exe._client.new(name="bounded", wait_until="created")
        assert time.monotonic() - started < 2  # read bound: 3/4 of the create timeout
        fake.reset()
        await exe.terminate("bounded")
    finally:
        await exe.aclose()


async def test_a_second_create_for_the_same_run_never_makes_a_second_vm(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    fake.faults.create_allocates_then_fails = True
    with pytest.raises(exedev.APIError):
        await provider._client.new(name=vm_name(spec("run_twice")), wait_until="created")
    fake.faults.create_allocates_then_fails = False
    with pytest.raises(ProviderError):  # the same name: 422 "already taken"
        async with provider.sandbox(spec("run_twice")):
            pytest.fail("no sandbox should be yielded")
    assert [entry["name"] for entry in fake.ledger.created] == [vm_name(spec("run_twice"))]
    assert fake.ledger.alive() == set()  # ...and the sweep by that name ended the first


async def test_a_rate_limit_carries_exe_devs_retry_after(
    fake: FakeExedev, provider: ExedevProvider
) -> None:
    fake.faults.rate_limited = 1
    fake.faults.retry_after = "3"
    with pytest.raises(ProviderRateLimited) as limited:
        await provider.list_owned()
    assert limited.value.retry_after == 3.0
    assert fake.ledger.verbs() == ["ls"]  # the SDK retried nothing


async def test_list_owned_keeps_to_its_cluster_and_reads_the_run_back(
    fake: FakeExedev,
) -> None:
    mine = ExedevProvider(settings_for(fake))
    other = ExedevProvider(settings_for(fake, cluster="test-2"))
    try:
        async with exedev.AsyncClient("admin", base_url=fake.url) as admin:
            await admin.new(name="test-foreign", wait_until="created")  # our prefix, no tags
        async with (
            other.sandbox(spec(cluster="test-2")) as theirs,
            mine.sandbox(spec("run_mine_0")) as box,
        ):
            owned = {ref.sandbox_id: ref for ref in await mine.list_owned()}
        assert set(owned) == {box.id} and theirs.id not in owned
        assert owned[box.id].run_id == "run_mine_0" and owned[box.id].created_at is not None
    finally:
        fake.call("delete", "test-foreign")
        await mine.aclose()
        await other.aclose()


async def test_a_tag_scoped_command_scoped_expiring_token_is_enough(fake: FakeExedev) -> None:
    """The token the README recommends: it sees and manages only VMs with its tag, VMs it
    creates get the tag, and it may run only new, ls, rm and ssh."""
    scoped = fake.issue_token(
        "relay-scoped",
        tag="relay-cluster-test",
        cmds=("new", "ls", "rm", "ssh"),
        expires_at=time.time() + 3600,
    )
    async with exedev.AsyncClient("admin", base_url=fake.url) as admin:
        await admin.new(name="test-not-the-relays", tags=["relay-run-x"], wait_until="created")
    exe = ExedevProvider(settings_for(fake, exedev_token=scoped))
    try:
        async with exe.sandbox(spec("run_scoped")) as box:
            status, sink = await run(box, ["echo", "scoped"])
            owned = {ref.sandbox_id for ref in await exe.list_owned()}
        assert (status, sink.text("stdout"), owned) == (0, "scoped\n", {box.id})
        assert fake.ledger.create_of(box.id)["by"] == "relay-scoped"  # type: ignore[index]
        assert fake.ledger.alive() == {"test-not-the-relays"}  # never its to see or end
    finally:
        fake.call("delete", "test-not-the-relays")
        await exe.aclose()
    for token in (
        fake.issue_token("no-ssh", cmds=("new", "ls", "rm")),
        fake.issue_token("expired", expires_at=time.time() - 1),
    ):
        refused = ExedevProvider(settings_for(fake, exedev_token=token))
        try:
            with pytest.raises(ProviderAuth):
                async with refused.sandbox(spec("run_refused")):
                    pytest.fail("no sandbox should be yielded")
        finally:
            await refused.aclose()
    assert fake.ledger.alive() == set()


# --- live -----------------------------------------------------------------------------------

# Read before the autouse fixture in tests/conftest.py clears RELAY_* from the environment.
LIVE_TOKEN = os.environ.get("RELAY_EXEDEV_TOKEN")


@pytest.mark.live
@pytest.mark.skipif(not LIVE_TOKEN, reason="needs RELAY_EXEDEV_TOKEN")
async def test_live_tiny_contract() -> None:
    settings = Settings(_env_file=None, cluster="relay-live-test", exedev_token=LIVE_TOKEN)  # type: ignore[call-arg]
    exe = ExedevProvider(settings)
    try:
        job = spec(run_id="run_live", timeout_s=60.0, cluster="relay-live-test")
        async with exe.sandbox(job) as box:
            await box.upload({"hello.txt": b"hi\n"})
            status, sink = await run(
                box, ["sh", "-c", "cat hello.txt; cat; echo $X"], stdin=b"in\n", env={"X": "y"}
            )
            assert (status, sink.text("stdout")) == (0, "hi\nin\ny\n")
            assert box.id in {ref.sandbox_id for ref in await exe.list_owned()}
        assert box.id not in {ref.sandbox_id for ref in await exe.list_owned()}
    finally:
        await exe.aclose()


# --- end to end: a real relay process with RELAY_PROVIDERS=exedev against the fake ---------


@pytest.fixture(scope="module")
def served() -> Iterator[FakeExedev]:
    with running_fake() as server:
        yield server


@pytest.fixture(scope="module")
def exedev_relay(
    served: FakeExedev, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("exedev-relay"),
        providers="exedev",
        exedev_url=served.url,
        exedev_token=SECRET_CANARY,
        max_wait_s=20,
        log_level="debug",  # httpx's own lines too: no env value in them
    )
    server.add_token("ops", command=True)
    server.start()
    yield server
    server.stop()
    assert SECRET_CANARY not in server.log() and BODY_MARKER not in server.log()


@pytest.mark.slow  # needs a relay process: seconds
def test_e2e_jobs_run_their_env_reaches_them_and_no_log_line(
    served: FakeExedev, exedev_relay: RelayProcess
) -> None:
    token = exedev_relay.tokens["ops"]
    echo = exedev_relay.post(token, {"job": "echo", "params": {"message": "hi; $(id)"}}).json()
    assert (echo["state"], echo["stdout"], echo["provider"]) == (
        "succeeded",
        "hi; $(id)\n",
        "exedev",
    )
    assert echo["cost_usd"] > 0
    snippet = "import json; print(json.load(open('params.json'))['label'])"
    python = exedev_relay.post(token, {"job": "python", "stdin": snippet}).json()
    assert (python["state"], python["stdout"]) == ("succeeded", "snippet\n"), python
    value = "env-value-canary-9e2d"
    request = {"command": ["sh", "-c", 'echo "$SECRET_VALUE"'], "env": {"SECRET_VALUE": value}}
    run = exedev_relay.post(token, request).json()
    assert (run["state"], run["stdout"]) == ("succeeded", f"{value}\n"), run
    log = exedev_relay.log()
    assert run["id"] in log and value not in log
    providers = exedev_relay.get(token, "/v1/providers").json()["providers"]
    assert providers == [{"name": "exedev", "enabled": True, "isolation": None, "limits": LIMITS}]
    assert served.ledger.alive() == set()


@pytest.mark.slow  # relay processes killed and restarted: seconds
def test_e2e_a_killed_relay_leaves_vms_the_next_one_reaps(fake: FakeExedev, tmp_path: Path) -> None:
    """exe.dev has no lifetime for a VM: after a ``kill -9`` mid-run and mid-create, the VMs
    live until the next relay's sweep, which finds both by tag and marks both runs lost."""
    report = killed_relay(fake, tmp_path)
    assert (report.created, report.leaked, report.not_final) == (2, [], [])
