"""The fake exe.dev (testing/fakes/exedev) driven by the real ``exedev`` 0.4.0 SDK.

Besides proving the fake speaks the SDK's wire, these tests pin down the SDK behaviour the
``exedev`` provider must work around: it retries only 429s, reads every answer for 600 s
whatever client it is given, and keeps a cancelled ``new()`` waiting for the create.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import exedev
import httpx
import pytest

from testing.fakes.exedev import BAD_KEY, BODY_MARKER, HOME, FakeExedev, running_fake
from testing.fakes.vercel.jail import bwrap

TOKEN = "exe1.test-token"


@pytest.fixture
def fake() -> Iterator[FakeExedev]:
    with running_fake() as fake:
        yield fake


@pytest.fixture
async def exe(fake: FakeExedev) -> AsyncIterator[exedev.AsyncClient]:
    async with exedev.AsyncClient(TOKEN, base_url=fake.url) as client:
        yield client


class BoundedRead(httpx.AsyncHTTPTransport):
    """Caps each request's read timeout: the SDK sets 600 s on every request it builds."""

    def __init__(self, read_s: float) -> None:
        super().__init__()
        self.read_s = read_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["timeout"] = {**request.extensions["timeout"], "read": self.read_s}
        return await super().handle_async_request(request)


async def eventually(check: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait (briefly) until ``check()`` holds."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("not in time")
        await asyncio.sleep(0.02)


# --- VMs and commands ----------------------------------------------------------------------


async def test_a_vm_is_created_listed_run_and_deleted_through_the_sdk(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(
        name="relay-box", tags=["relay", "run-a"], image="ubuntu:24.04", env={"MODE": "ci"}
    )
    assert (vm.name, vm.tags, vm.status) == ("relay-box", ("relay", "run-a"), "running")
    created = fake.ledger.create_of("relay-box")
    assert created is not None
    assert created["tags"] == ["relay", "run-a"]
    assert (created["env_names"], created["image"], created["by"]) == (
        ["MODE"],
        "ubuntu:24.04",
        TOKEN,
    )
    assert created["flags"]["no-email"] is True  # the SDK asks for no email
    assert [listed.name for listed in await exe.vms("relay-*")] == ["relay-box"]
    assert await exe.vms("other-*") == []

    result = await vm.run("echo out; echo err >&2; echo $MODE; pwd; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, f"out\nci\n{HOME}\n", "err\n")

    await vm.delete()
    assert fake.ledger.alive() == set()
    assert [(entry["name"], entry["by"]) for entry in fake.ledger.deleted] == [("relay-box", TOKEN)]
    assert await exe.vms() == []


async def test_run_exports_env_and_changes_directory_without_wiping_the_vm_environment(
    exe: exedev.AsyncClient,
) -> None:
    async with exe.new(name="envbox", env={"FROM_VM": "kept"}) as vm:
        result = await vm.run(
            ["sh", "-c", 'printf "%s|%s|%s|%s" "$FROM_VM" "$ODD" "$(pwd)" "$HOME"'],
            env={"ODD": "a b 'c' $d"},
            cwd="/tmp",
        )
        assert result.stdout == f"kept|a b 'c' $d|/tmp|{HOME}"
        missing = await vm.run("true", cwd="/no/such/dir")
        assert missing.exit_code != 0  # `cd X || exit`: never the wrong directory


async def test_files_go_in_and_out_through_shell_scripts_sent_over_ssh(
    fake: FakeExedev, exe: exedev.AsyncClient, tmp_path: Path
) -> None:
    async with exe.new(name="files") as vm, exe.new(name="other") as other:
        await vm.write_file("app/config.json", '{"a": 1}')
        await vm.write_file("/tmp/tool", "#!/bin/sh\necho tool\n", mode=0o755)
        noise = base64.b64encode(bytes(range(256)) * 400).decode() * 2  # ~270 KB: sent in parts
        await vm.write_file("big.txt", noise)
        assert await vm.read_file("app/config.json") == b'{"a": 1}'
        assert (await vm.run("/tmp/tool")).stdout == "tool\n"
        assert await vm.read_file("big.txt") == noise.encode()
        with pytest.raises(FileNotFoundError):
            await vm.read_file("missing.txt")
        with pytest.raises(IsADirectoryError):
            await vm.read_file("app")
        with pytest.raises(FileNotFoundError):  # each VM has its own disk
            await other.read_file("app/config.json")
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "a.txt").write_text("A")
        await vm.upload(tmp_path / "src", "project")
        await vm.download("project", tmp_path / "back")
        assert (tmp_path / "back" / "a.txt").read_text() == "A"
    assert fake.ledger.alive() == set()


async def test_the_ssh_answer_is_an_ndjson_stream_with_heartbeats_and_an_exit_code(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    await exe.new(name="wire", wait_until="created")
    fake.faults.heartbeat_s = 0.1
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/x-ndjson"}
    lines: list[bytes] = []
    # The command waits, after its output, until the test has read that output and two
    # heartbeats: live output, not output sent at the end, however slow the machine.
    go = fake.world.vms["wire"].root / HOME.lstrip("/") / "go"
    command = "ssh wire 'echo one; echo two >&2; until [ -e go ]; do sleep 0.02; done; exit 7'"
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", f"{fake.url}/exec", headers=headers, content=command) as response,
    ):
        assert response.headers["content-type"] == "application/x-ndjson"
        async for line in response.aiter_lines():
            lines.append(line.encode())
            outputs = [line for line in lines if line]
            if len(outputs) == 2 and lines[lines.index(outputs[-1]) :].count(b"") >= 2:
                go.touch()
    assert go.exists(), "the command ended before its output and two heartbeats were read"
    frames = [json.loads(line) for line in lines if line]
    decoded = [
        (key, base64.b64decode(value)) for frame in frames[:-1] for key, value in frame.items()
    ]
    assert sorted(decoded) == [("stderr", b"two\n"), ("stdout", b"one\n")]
    assert frames[-1] == {"exit_code": 7}
    # With the SDK, heartbeats are invisible and the streams stay apart.
    vm = await exe.vm("wire")
    result = await vm.run("echo one; sleep 0.3; echo two >&2")
    assert (result.stdout, result.stderr) == ("one\n", "two\n")


# --- refusals --------------------------------------------------------------------------------


async def test_a_taken_name_is_a_422_and_never_a_second_vm(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    await exe.new(name="once", wait_until="created")
    with pytest.raises(exedev.APIError) as raised:
        await exe.new(name="once", wait_until="created")
    assert raised.value.status == 422 and "already taken" in str(raised.value)
    assert [entry["name"] for entry in fake.ledger.created] == ["once"]


async def test_a_429_is_retried_after_its_retry_after_and_raised_when_retries_run_out(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    fake.faults.rate_limited = 1
    started = time.monotonic()
    assert await exe.vms() == []
    assert time.monotonic() - started >= 1.0  # Retry-After: 1, above the 0.5 s backoff
    assert fake.ledger.verbs() == ["ls", "ls"]
    fake.faults.rate_limited = 1
    async with exedev.AsyncClient(TOKEN, base_url=fake.url, max_retries=0) as impatient:
        with pytest.raises(exedev.RateLimitError) as raised:
            await impatient.vms()
    assert raised.value.status == 429 and BODY_MARKER in raised.value.body


async def test_a_5xx_on_new_is_raised_at_once_without_a_vm(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    fake.faults.create_status = 503
    with pytest.raises(exedev.APIError) as raised:
        await exe.new(name="never")
    assert raised.value.status == 503
    assert fake.ledger.verbs() == ["new"]  # no retry
    assert fake.ledger.created == []


async def test_a_create_that_allocates_then_fails_leaves_a_vm_the_sdk_never_learned(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    fake.faults.create_allocates_then_fails = True
    with pytest.raises(exedev.APIError):
        await exe.new(name="orphan", tags=["relay"])
    assert fake.ledger.alive() == {"orphan"}  # only its name finds it now
    fake.reset()
    assert (await exe.delete("orphan"))["deleted"] == ["orphan"]


async def test_tokens_are_refused_by_kind_scope_and_expiry(fake: FakeExedev) -> None:
    for token, error in [
        (BAD_KEY, exedev.AuthenticationError),
        (fake.issue_token("old", expires_at=time.time() - 1), exedev.AuthenticationError),
        (fake.issue_token("lister", cmds=("ls",)), exedev.PermissionDeniedError),
    ]:
        async with exedev.AsyncClient(token, base_url=fake.url) as client:
            with pytest.raises(error):
                await client.new(name="x", wait_until="created")
    assert fake.ledger.created == []
    lister = fake.issue_token("lister", cmds=("ls", "ssh one"))
    async with exedev.AsyncClient(TOKEN, base_url=fake.url) as admin:
        await admin.new(name="one", wait_until="created")
        await admin.new(name="two", wait_until="created")
    async with exedev.AsyncClient(lister, base_url=fake.url) as client:  # ls, and ssh on one VM
        assert {vm.name for vm in await client.vms()} == {"one", "two"}
        assert (await (await client.vm("one")).run("echo hi")).stdout == "hi\n"
        with pytest.raises(exedev.PermissionDeniedError):
            await (await client.vm("two")).run("echo hi")


async def test_a_tag_scoped_token_sees_and_manages_only_vms_with_its_tag(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    await exe.new(name="foreign", wait_until="created")
    scoped = fake.issue_token("relay", tag="relay")
    async with exedev.AsyncClient(scoped, base_url=fake.url) as client:
        mine = await client.new(name="mine", tags=["run-b"])
        assert mine.tags == ("run-b", "relay")  # VMs it creates get its tag
        assert [vm.name for vm in await client.vms()] == ["mine"]
        with pytest.raises(exedev.NotFoundError):
            await client.vm("foreign")
        summary = await client.delete("foreign", "mine")
        assert (summary["deleted"], summary["not_found"]) == (["mine"], ["foreign"])
    assert fake.ledger.alive() == {"foreign"}
    assert fake.ledger.create_of("mine")["by"] == "relay"  # type: ignore[index]


# --- a VM lost under a command, and dropped requests -----------------------------------------


async def test_a_vm_stopped_under_a_command_interrupts_it_and_refuses_the_next_run(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(name="crashy")

    async def stop_the_vm(line: str) -> None:
        await asyncio.to_thread(fake.call, "stop", "crashy")

    with pytest.raises(exedev.CommandInterruptedError) as raised:
        await vm.run("echo started; sleep 30", on_stdout=stop_the_vm, timeout=10)
    assert raised.value.stdout == "started\n" and raised.value.reason == 'VM "crashy" stopped'
    with pytest.raises(exedev.VMNotRunningError):
        await vm.run("true")
    assert [row.status for row in await exe.vms("crashy")] == ["stopped"]
    await vm.restart()
    assert (await vm.run("echo back")).stdout == "back\n"


async def test_a_vm_deleted_under_a_command_interrupts_it(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(name="vanishing")
    await asyncio.to_thread(fake.call, "delete", "vanishing")
    with pytest.raises(exedev.NotFoundError):  # 422 `VM "x" not found`, mapped by the SDK
        await vm.run("true")
    # Deleted once its command runs (the moment a timed vanish could miss on a busy machine).
    doomed = await exe.new(name="vanishes-too", wait_until="created")
    sessions = fake.world.vms["vanishes-too"].sessions
    command = asyncio.create_task(doomed.run("echo started; sleep 30", timeout=10))
    await eventually(lambda: any(s.process for s in list(sessions)) or command.done())
    started = time.monotonic()
    await asyncio.to_thread(fake.call, "delete", "vanishes-too")
    with pytest.raises(exedev.CommandInterruptedError):
        await command
    assert time.monotonic() - started < 5
    # The fault deletes a VM by itself, as `rm` would.
    fake.faults.vanish_after_s = 0.1
    await exe.new(name="vanishes-by-itself", wait_until="created")
    await eventually(lambda: fake.ledger.alive() == set())


async def test_a_dropped_request_kills_its_command_unless_told_otherwise(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(name="dropper")
    sessions = fake.world.vms["dropper"].sessions
    with pytest.raises(exedev.CommandTimeoutError):
        await vm.run("sleep 30", timeout=0.3)
    await eventually(lambda: not sessions)
    fake.faults.commands_outlive_request = True
    with pytest.raises(exedev.CommandTimeoutError):
        await vm.run("sleep 30", timeout=0.3)
    await asyncio.sleep(0.3)
    assert len(sessions) == 1  # still running: only rm stops it now
    await vm.delete()
    await eventually(lambda: not sessions)


async def test_a_cut_stream_is_an_interrupted_command_with_its_first_output(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(name="cut")
    fake.faults.cut_stream = True
    with pytest.raises(exedev.CommandInterruptedError) as raised:
        await vm.run("echo one; sleep 0.2; echo two")
    assert raised.value.stdout == "one\n"


@pytest.mark.skipif(
    bwrap() is None, reason="egress is enforced with bubblewrap's network namespace"
)
async def test_egress_restricted_to_integrations_leaves_a_vm_without_a_network(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    interfaces = "awk -F: 'NR>2 {gsub(/ /, \"\", $1); print $1}' /proc/net/dev | sort"
    closed = await exe.new(name="closed", egress="integrations")
    assert closed.egress == "integrations"
    assert (await closed.run(interfaces)).stdout == "lo\n"
    opened = await exe.new(name="opened")
    assert (await opened.run(interfaces)).stdout != "lo\n"
    assert (await opened.set_egress("integrations"))["egress_policy"] == "integrations"
    assert (await opened.run(interfaces)).stdout == "lo\n"


# --- the SDK's timeouts and its shielded new(): the hazards the provider works around -------


async def test_the_sdk_sets_a_600_s_read_timeout_whatever_client_it_is_given(
    fake: FakeExedev,
) -> None:
    seen: list[dict[str, float]] = []

    async def note(request: httpx.Request) -> None:
        seen.append(request.extensions["timeout"])

    async with (
        httpx.AsyncClient(timeout=0.2, event_hooks={"request": [note]}) as http,
        exedev.AsyncClient(TOKEN, base_url=fake.url, http_client=http) as client,
    ):
        await client.vms()
    assert seen[0]["read"] == 600.0  # the client's own 0.2 s is overridden per request


@pytest.mark.parametrize(
    ("fault", "verb"),
    [
        ("create_hang", "new"),
        ("create_hang_before_allocating", "new"),
        ("list_hang", "ls"),
        ("terminate_hang", "rm"),
    ],
)
async def test_a_hang_is_a_network_error_once_the_read_is_bounded_by_our_transport(
    fake: FakeExedev, fault: str, verb: str
) -> None:
    async with exedev.AsyncClient(TOKEN, base_url=fake.url) as admin:
        await admin.new(name="present", wait_until="created")
    setattr(fake.faults, fault, True)
    async with (
        httpx.AsyncClient(transport=BoundedRead(0.3)) as http,
        exedev.AsyncClient(TOKEN, base_url=fake.url, http_client=http) as client,
    ):
        started = time.monotonic()
        with pytest.raises(exedev.NetworkError):
            if verb == "new":
                await client.new(name="hung", wait_until="created")
            elif verb == "ls":
                await client.vms()
            else:
                await client.delete("present")
        assert time.monotonic() - started < 2
    made = {entry["name"] for entry in fake.ledger.created}
    # A create hung after making its VM leaves one the SDK never learned: sweep it by name.
    assert made == ({"present", "hung"} if fault == "create_hang" else {"present"})


async def test_a_cancelled_new_keeps_waiting_for_the_create_then_deletes_the_vm(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    fake.faults.create_hang = True
    creating = asyncio.ensure_future(exe.new(name="shielded", wait_until="created"))
    await eventually(lambda: "shielded" in fake.ledger.alive())
    creating.cancel()
    await asyncio.sleep(0.3)
    assert not creating.done()  # shielded: the cancel waits for the create's answer
    fake.reset()  # the late answer arrives
    with pytest.raises(asyncio.CancelledError):
        await creating
    assert fake.ledger.alive() == set()  # ... and the SDK deleted what it made


async def test_a_second_cancel_gives_up_on_the_create_and_leaves_its_vm(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    fake.faults.create_hang = True
    creating = asyncio.ensure_future(exe.new(name="abandoned", wait_until="created"))
    await eventually(lambda: "abandoned" in fake.ledger.alive())
    creating.cancel()
    await asyncio.sleep(0.1)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(creating, 2)
    fake.reset()
    await asyncio.sleep(0.2)
    assert fake.ledger.alive() == {"abandoned"}  # left for the sweep by name


async def test_a_process_spawned_in_a_session_of_its_own_outlives_its_request_until_rm(
    fake: FakeExedev, exe: exedev.AsyncClient
) -> None:
    vm = await exe.new(name="spawner")
    process = await vm.spawn("echo begun; sleep 30", name="long")
    await asyncio.sleep(0.3)
    assert await process.poll() is None  # still running: a VM's, not its request's
    assert (await process.logs()).stdout == "begun\n"
    pid = process.pid
    await vm.delete()
    ended = await asyncio.to_thread(_gone_within, pid, 5.0)
    assert ended, "a process of a deleted VM survived it"


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends within ``seconds`` (a VM's commands get no PID namespace
    of their own in the fake: the pid ``spawn()`` reports is the host's)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False
