"""Attacks found in a hostile-tenant review of the ``local`` provider after issue 17: each
test failed before its fix. Small limits and short timeouts keep each under a few seconds."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.providers.local import private_network
from relay.providers.local.invocation import bwrap_works
from testing.relay_server import RelayProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working"),
]

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


def _child_pids(pid: int) -> list[tuple[int, str]]:
    """``pid``'s child processes and their command names."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().split()[3] == str(pid):
                found.append((int(entry.name), (entry / "comm").read_text().strip()))
        except (OSError, IndexError):
            continue
    return found


def _children(pid: int) -> list[str]:
    """The command names of ``pid``'s child processes."""
    return [name for _, name in _child_pids(pid)]


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


@pytest.mark.parametrize(
    "body",
    [
        {"files": {".": "x"}},
        {"files": {"x" * 300: "x"}},
        {"files": {"a/" * 600 + "f": "x"}},
        {"files": {"a\u0000b": "x"}},
        {"files": {"a": "x", "a/b": "y"}},
        {"files": {"sub": "x"}, "workdir": "sub/deeper"},
    ],
    ids=["dot", "long-name", "long-path", "nul", "file-and-folder", "file-as-workdir"],
)
def test_upload_paths_a_sandbox_cannot_hold_are_422(
    relay: RelayProcess, body: dict[str, object]
) -> None:
    """These were 502 ``provider_error`` ("could not set up the sandbox's limits")."""
    answer = relay.post(relay.tokens["commands"], {"command": ["true"], **body})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "validation_error"


@needs_network
@pytest.mark.skipif(
    not os.access("/sys/fs/cgroup/memory", os.W_OK), reason="no writable cgroup v1 here"
)
def test_a_relay_killed_mid_run_leaves_no_networking_process_after_restart(
    tmp_path: Path,
) -> None:
    """pasta outlived a relay killed with SIGKILL, and the next relay's start too."""
    server = RelayProcess(tmp_path / "relay", **LIMITS)
    token = server.add_token("commands", command=True)
    server.start()
    try:
        body = {"command": ["sleep", "20"], "egress": ["*"], "wait": False}
        server.post(token, body)
        assert server.process is not None
        deadline = time.monotonic() + 5
        tools: list[int] = []
        while not tools and time.monotonic() < deadline:
            tools = [pid for pid, name in _child_pids(server.process.pid) if name != "bwrap"]
            time.sleep(0.05)
        assert tools, "the run's network never started"
        server.kill()  # as early as it can be: the tool has only just started
        server.start()
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in tools):
            assert time.monotonic() < deadline, "the networking process outlived its relay"
            time.sleep(0.05)
    finally:
        server.stop()
