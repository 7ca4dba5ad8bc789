"""Attacks found in a hostile-tenant review of the ``local`` provider after issue 17: each
test failed before its fix. Small limits and short timeouts keep each under a few seconds."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.providers import private_network
from relay.providers.base import Egress, OutputSink, SandboxSpec
from relay.providers.local import LocalProvider, bwrap_works
from tests.conftest import make_settings
from tests.relay_server import RelayProcess

pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working")

LIMITS = {
    "local_isolation": "bwrap",
    "local_max_memory_mb": 64,
    "local_max_disk_mb": 16,
    "local_pids_max": 32,
}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("reviewed"), **LIMITS)
    server.add_token("jobs", jobs=["python", "echo"])
    server.add_token("commands", command=True)
    server.start()
    yield server
    server.stop()


needs_network = pytest.mark.skipif(
    os.geteuid() != 0 or private_network.available() is None,
    reason="needs root, bubblewrap and pasta or slirp4netns",
)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_network
async def test_a_cancel_while_the_network_attaches_leaves_no_networking_process(
    tmp_path: Path,
) -> None:
    """A DELETE that lands while pasta/slirp4netns starts left the tool running, holding
    the sandbox's network namespace, for as long as the relay lived."""
    provider = LocalProvider(make_settings(tmp_path, **LIMITS))
    spec = SandboxSpec(run_id="run_cancel", cluster="test", timeout_s=5, egress=Egress(("*",)))
    try:
        async with provider.sandbox(spec) as box:
            run = asyncio.create_task(
                box.exec(
                    ["true"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=5,
                    output=OutputSink(1024),
                )
            )
            deadline = time.monotonic() + 5
            while not _processes_mentioning(box.id) and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
            assert _processes_mentioning(box.id), "the network never started"
            run.cancel()  # the tool runs (its command names the sandbox's folder)
            with pytest.raises(asyncio.CancelledError):
                await run
            sandbox_id = box.id
    finally:
        await provider.aclose()
    await asyncio.sleep(0.2)
    assert _processes_mentioning(sandbox_id) == [], "a networking process outlived its run"


def _children(pid: int) -> list[str]:
    """The command names of ``pid``'s child processes."""
    names = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().split()[3] == str(pid):
                names.append((entry / "comm").read_text().strip())
        except (OSError, IndexError):
            continue
    return names


@needs_network
def test_deletes_racing_a_runs_creation_leave_no_networking_process(
    relay: RelayProcess,
) -> None:
    """DELETE within the first ~100 ms of an egress ["*"] run (the relay runs on uvloop)."""
    assert relay.process is not None
    token = relay.tokens["commands"]
    body = {"command": ["sleep", "5"], "egress": ["*"], "wait": False, "timeout_s": 5}
    for attempt in range(24):
        run_id = relay.post(token, body).json()["id"]
        time.sleep(attempt * 0.005)
        assert relay.delete(token, f"/v1/runs/{run_id}").status_code == 200
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and set(_children(relay.process.pid)) - {"bwrap"}:
        time.sleep(0.1)
    assert _children(relay.process.pid) == [], "a process outlived its canceled run"
