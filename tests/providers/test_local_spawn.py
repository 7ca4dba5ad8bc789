"""The local provider starts sandboxes without forking the relay; limits and the tie to
the relay's life hold all the same (relay/providers/local/spawn.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

from relay.cancellation import Deadline
from relay.providers.contract import SANDBOX_MARKER, Egress, OutputSink, SandboxSpec
from relay.providers.local import spawn
from relay.providers.local.invocation import HOST_ENV, base_rlimits, bwrap_works
from relay.providers.local.provider import LocalProvider
from relay.providers.local.root import marked_pids
from relay.providers.local.sandbox import LocalSandbox
from testing.host import sleep_marker
from testing.relay_server import RelayProcess
from tests.conftest import make_settings

needs_bwrap = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working")
LIMIT_ROWS = {
    "cpu": "Max cpu time",
    "fsize": "Max file size",
    "as": "Max address space",
    "nofile": "Max open files",
}


def _limits_seen(text: str) -> dict[str, tuple[int, int]]:
    """{name: (soft, hard)} from /proc/self/limits."""
    seen = {}
    for line in text.splitlines():
        for name, row in LIMIT_ROWS.items():
            if line.startswith(row):
                soft, hard = line[len(row) :].split()[:2]
                seen[name] = (int(soft), int(hard))
    return seen


@pytest.mark.parametrize(
    "isolation", [pytest.param("bwrap", marks=needs_bwrap), pytest.param("none")]
)
async def test_the_job_runs_under_the_sandbox_limits(tmp_path: Path, isolation: str) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation=isolation))
    spec = SandboxSpec(run_id="run_limits", cluster="test", timeout_s=20, grace_s=10)
    sink = OutputSink(65536)
    try:
        async with provider.sandbox(spec) as box:
            result = await box.exec(
                ["cat", "/proc/self/limits"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=20,
                output=sink,
            )
    finally:
        await provider.aclose()
    assert result.exit_code == 0
    cpu_s = int(spec.lifetime_s)
    expected = base_rlimits(cpu_s, spec.resources.memory_mb, provider.budget.open_files)
    assert _limits_seen(sink.text("stdout")) == expected


@needs_bwrap
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="prlimit (util-linux) missing")
def test_a_bwrap_sandbox_is_started_without_a_fork_of_the_relay(tmp_path: Path) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    spec = SandboxSpec(run_id="run_spawn", cluster="test", timeout_s=5, egress=Egress(()))
    box = LocalSandbox(provider, "lcl-spawn", spec)
    box.uid = provider.uids.take() if provider.uids is not None else None  # as root
    invocation = box.launch(["true"], "/workspace", 10, {"LD_PRELOAD": "/x.so"}, lifetime_s=10)
    invocation.close()
    if box.uid is not None:
        box.uid.release()
    assert invocation.setup is None  # no preexec_fn, so subprocess may vfork
    assert invocation.argv[0].endswith("prlimit") and "--args" in invocation.argv
    # The job's variables never reach a host process; the sandbox's marker does.
    assert invocation.env == {**HOST_ENV, SANDBOX_MARKER: "lcl-spawn"}
    assert spawn.PIDFDS  # this kernel has pidfds, so the Popen path is the one in use


@pytest.mark.slow  # needs a relay process: seconds
@needs_bwrap
def test_killing_the_relay_kills_its_sandboxes(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path / "relay", local_isolation="bwrap")
    token = relay.add_token("ops", jobs=["sleep"])
    relay.start()
    try:
        run = relay.post(token, {"job": "sleep", "params": {"seconds": 60}, "wait": False}).json()
        deadline = time.monotonic() + 20
        sandbox_id = None
        while time.monotonic() < deadline and not sandbox_id:
            current = relay.get(token, f"/v1/runs/{run['id']}").json()
            if current["state"] == "running" and marked_pids(current["sandbox_id"]):
                sandbox_id = current["sandbox_id"]
            time.sleep(0.05)
        assert sandbox_id, "the sleep job never started"
        relay.kill()  # SIGKILL: no cleanup runs in the relay
        deadline = time.monotonic() + 10
        while marked_pids(sandbox_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_pids(sandbox_id) == []
    finally:
        relay.kill()


@pytest.mark.skipif(not spawn.PIDFDS, reason="no pidfds: spawn falls back to asyncio")
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4])
async def test_a_spawn_cancelled_midway_leaves_no_process_and_no_pipe(
    tmp_path: Path, steps: int
) -> None:
    # A DELETE (or shutdown) can land while the child's pipes are being handed to the
    # loop; cancelling after `steps` loop turns covers every await in spawn().
    # A duration no other process on the machine uses: the child is found by it alone.
    sleeping = f"sleep {sleep_marker(30)}"
    argv = ["sh", "-c", f"exec {sleeping}"]
    ours = {child.pid for child in psutil.Process().children()}
    task = asyncio.create_task(spawn.spawn(argv, stdin=True, env={}, cwd=None, preexec_fn=None))
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        child = await task
    except asyncio.CancelledError:
        child = None
    if child is not None:  # finished before the cancel landed: the caller owns it
        spawn._kill(child.pid)
        await child.wait()
        spawn.close(child)
        return
    # Reaped before the cancel returns, not on some later loop turn: a test (or a relay)
    # whose loop ends next would leave a child it never waited for.
    assert {child.pid for child in psutil.Process().children()} == ours
    assert _pids_running(sleeping) == []
    gc.collect()  # an unclosed pipe would warn here, and warnings are errors


def _pids_running(command: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmdline.strip() == command:
                found.append(int(entry.name))
    return found


@needs_bwrap
def test_an_invocation_never_closes_a_number_twice(tmp_path: Path) -> None:
    provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    box = LocalSandbox(
        provider, "lcl-fds", SandboxSpec(run_id="run_fds", cluster="test", timeout_s=5)
    )
    box.uid = provider.uids.take() if provider.uids is not None else None  # as root
    invocation = box.launch(["true"], "/workspace", 10, {}, lifetime_s=10)
    if box.uid is not None:
        box.uid.release()
    invocation.close_child_ends()
    reused = os.pipe()  # takes the lowest free numbers: those just closed
    try:
        invocation.close()
        for fd in reused:
            os.fstat(fd)  # still open: another object's fd was not closed under it
    finally:
        for fd in reused:
            os.close(fd)


@needs_bwrap
async def test_an_exec_ended_by_its_deadline_finishes_its_cleanup(tmp_path: Path) -> None:
    # The run's exec deadline cancels again every loop turn until the exec ends (an SDK
    # may swallow one): the command's cleanup (pumps, pipes, private network) must still
    # run to its end, not stop at its first await.
    provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    try:
        async with provider.sandbox(SandboxSpec("run_deadline", "test", 30)) as box:
            assert isinstance(box, LocalSandbox)
            with pytest.raises(TimeoutError), Deadline(0.2):
                await box.exec(
                    ["sleep", "30"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=30,
                    output=OutputSink(1000),
                )
            (child,) = box.processes
            assert isinstance(child, spawn.PopenChild)
            assert all(transport.is_closing() for transport in child._transports)
    finally:
        await provider.aclose()
