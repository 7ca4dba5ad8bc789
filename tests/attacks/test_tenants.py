"""Tenants apart (issue 34), against a real ``relay serve`` with bubblewrap and small limits:
a bounded share of the host's file table and of the relay's slots, a uid of each sandbox's
own, no caching of answers that carry output, no URL built from the caller's ``Host``, and
only the sandbox's own names in it. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.providers.local.invocation import bwrap_works
from testing.host import sleep_marker, uid_range
from testing.relay_server import RelayProcess

pytestmark = [
    pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working"),
    pytest.mark.slow,
]  # needs a relay process: seconds

MEMORY_MB, DISK_MB, PIDS, OPEN_FILES, SLOTS = 64, 16, 32, 64, 8
FIRST_UID, LAST_UID = uid_range(16)
"""Of this run's own: the checks below find every process and lock of the range."""
LIMITS = {
    "local_isolation": "bwrap",
    "local_max_memory_mb": MEMORY_MB,
    "local_max_disk_mb": DISK_MB,
    "local_pids_max": PIDS,
    "local_open_files": OPEN_FILES,
    "local_uids": f"{FIRST_UID}-{LAST_UID}",
    "max_concurrent": SLOTS,
}
ACCEPT = {"Accept": "application/json, text/event-stream"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only a root relay switches uids")


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("tenants"), **LIMITS)
    server.add_token("alpha", jobs=["python", "echo", "sleep"])
    server.add_token("beta", jobs=["echo"])
    server.add_token("commands", command=True)
    server.start()
    yield server
    server.stop()


def _echo(relay: RelayProcess, **headers: str) -> httpx.Response:
    body = {"job": "echo", "params": {"message": "still here"}}
    return relay.post(relay.tokens["beta"], body, **headers)


def _open_files() -> int:
    """Open files on the whole host (the first field of ``fs.file-nr``)."""
    return int(Path("/proc/sys/fs/file-nr").read_text().split()[0])


FILL_FILES = """
import os, sys, time
children = []
for _ in range(PIDS):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.write(1, b"%d\\n" % len(held))
        time.sleep(3)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""


def test_one_sandbox_holds_its_budget_of_open_files_and_no_more(relay: RelayProcess) -> None:
    """Each process had 1024 open files: RELAY_LOCAL_PIDS_MAX processes of them let one
    sandbox take a tenth of the host's file table, and a dozen runs filled it."""
    before = _open_files()
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _open_files())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    answer: dict[str, Any] = {}
    code = FILL_FILES.replace("PIDS", str(PIDS))
    body = {"job": "python", "stdin": code, "timeout_s": 20}
    filler = threading.Thread(
        target=lambda: answer.update(relay.post(relay.tokens["alpha"], body).json())
    )
    filler.start()
    try:
        time.sleep(1.5)  # the children hold their files for 3 s
        other = _echo(relay)
    finally:
        filler.join(40)
        done.set()
        watcher.join()
    assert other.status_code == 200 and other.json()["state"] == "succeeded", other.text
    held = [int(line) for line in answer["stdout"].split()]
    assert len(held) >= PIDS // 2, answer  # the sandbox did fill its processes
    assert sum(held) <= PIDS * OPEN_FILES, held
    # The host's count rose by the sandbox's budget at most (a margin for the rest of a
    # busy machine): it was 30 times that before.
    assert peak[0] - before < PIDS * OPEN_FILES + 4000, (before, peak[0])


def test_a_relay_whose_sandboxes_could_fill_the_file_table_does_not_start(
    tmp_path: Path,
) -> None:
    limit = int(Path("/proc/sys/fs/file-max").read_text())
    sandboxes = limit // 4 // 100 + 1  # under 100 open files a sandbox: no way to fit
    server = RelayProcess(
        tmp_path / "relay", local_isolation="bwrap", local_max_sandboxes=sandboxes,
        max_concurrent=sandboxes, local_uids=f"{FIRST_UID}-{FIRST_UID + 15}",
    )  # fmt: skip
    server.add_token("ops", jobs=["echo"])
    try:
        with pytest.raises(RuntimeError, match="relay exited at start"):
            server.start()
    finally:
        server.stop()
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert len(lines) == 1 and "fs.file-max" in lines[0], lines


def _sleeping(relay: RelayProcess, marker: str, secret: str) -> threading.Thread:
    """A sandbox that writes a file, then sleeps (a duration no other process uses)."""
    script = f"echo {secret} > /workspace/mine; exec sleep {marker}"
    body = {"command": ["sh", "-c", script], "env": {"TENANT_SECRET": secret}}
    thread = threading.Thread(target=lambda: relay.post(relay.tokens["commands"], body))
    thread.start()
    return thread


def _job_process(marker: str) -> tuple[int, int]:
    """The host pid and uid of the sandbox process sleeping ``marker`` seconds."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_bytes().split(b"\0")[:2] == [
                    b"sleep",
                    marker.encode(),
                ]:
                    return int(entry.name), entry.stat().st_uid
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no sandbox process sleeps {marker}")


def _read_as(uid: int, path: str) -> subprocess.CompletedProcess[bytes]:
    reader = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "cat", path]
    return subprocess.run(reader, capture_output=True, timeout=10, check=False)


def _uids_in_use() -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                found.add(entry.stat().st_uid)
        except OSError:
            continue
    return {uid for uid in found if FIRST_UID <= uid <= LAST_UID}


@needs_root
def test_each_sandbox_has_a_uid_no_other_process_can_read_it_with(relay: RelayProcess) -> None:
    """Every sandbox of a root relay ran as the host's nobody (65534): any nobody process
    read a live sandbox's environment and files, and sandboxes shared per-user limits."""
    stamp = secrets.token_hex(4)
    markers = [sleep_marker(4), sleep_marker(4)]
    threads = [_sleeping(relay, marker, f"secret-{n}-{stamp}") for n, marker in enumerate(markers)]
    try:
        (first, first_uid), (second, second_uid) = map(_job_process, markers)
        assert first_uid != second_uid
        assert {first_uid, second_uid} <= set(range(FIRST_UID, LAST_UID + 1))
        environ = f"/proc/{first}/environ"
        files = f"/proc/{first}/root/workspace/mine"
        secret = f"secret-0-{stamp}".encode()
        assert secret in Path(environ).read_bytes()  # the right process: root reads it
        for reader in (65534, second_uid, 12345):  # nobody, the other tenant, anyone
            for path in (environ, files):
                seen = _read_as(reader, path)
                assert seen.returncode != 0 and secret not in seen.stdout, (reader, path)
    finally:
        for thread in threads:
            thread.join(20)
    # Nothing of theirs is left: no process, no file, no held uid.
    deadline = time.monotonic() + 5
    while _uids_in_use() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uids_in_use() == set()
    root = relay.root / "sandboxes"
    owned = [path for path in root.rglob("*") if path.lstat().st_uid >= FIRST_UID]
    assert owned == [], owned
    held = Path("/proc/net/unix").read_text()
    assert not any(f"@relay-uid-{uid}" in held for uid in range(FIRST_UID, LAST_UID + 1))


def test_one_token_cannot_take_every_slot(relay: RelayProcess) -> None:
    """With no max_concurrent of its own, 8 sleeps of one token took all 8 slots and
    another token's echo got 429 until they ended."""
    alpha = relay.tokens["alpha"]
    body = {"job": "sleep", "params": {"seconds": 15}, "wait": False}
    answers = [relay.post(alpha, body) for _ in range(SLOTS)]
    started = [a.json()["id"] for a in answers if a.status_code == 202]
    try:
        refused = [a for a in answers if a.status_code == 429]
        assert len(started) == SLOTS // 2 and len(refused) == SLOTS // 2, answers
        error = refused[0].json()["error"]
        assert error["code"] == "rate_limited" and "share" in error["message"], error
        assert int(refused[0].headers["Retry-After"]) >= 1
        other = _echo(relay)
        assert other.status_code == 200 and other.json()["state"] == "succeeded", other.text
    finally:
        for run_id in started:
            relay.delete(alpha, f"/v1/runs/{run_id}")


def test_answers_that_carry_output_are_never_stored(relay: RelayProcess) -> None:
    token = relay.tokens["beta"]
    created = _echo(relay)
    run_id = created.json()["id"]
    accepted = relay.post(token, {"job": "echo", "params": {"message": "x"}, "wait": False})
    answers = {
        "POST": created,
        "POST 202": accepted,
        "GET": relay.get(token, f"/v1/runs/{run_id}"),
        "list": relay.get(token, "/v1/runs"),
        "events": relay.get(token, f"/v1/runs/{run_id}/events"),
        "refusal": relay.get(token, "/v1/runs/run_none"),
    }
    with httpx.Client(base_url=relay.url, timeout=30) as client:
        headers = relay.headers(token, **ACCEPT)
        initialize = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "1"}},
        }  # fmt: skip
        opened = client.post("/mcp", json=initialize, headers=headers)
        headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
        ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        client.post("/mcp", json=ready, headers=headers)
        call = {
            "jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"message": "tool output"}},
        }  # fmt: skip
        answers["mcp"] = client.post("/mcp", json=call, headers=headers)
        assert "tool output" in answers["mcp"].text
    for name, answer in answers.items():
        assert answer.status_code < 500, (name, answer.text)
        directives = answer.headers.get("cache-control", "").split(", ")
        assert "no-store" in directives, (name, directives)
    console = httpx.get(relay.url + "/console", timeout=10)
    assert console.headers["cache-control"] == "no-store"  # its own, as before


def test_a_callers_host_header_never_builds_a_url(relay: RelayProcess) -> None:
    """Without RELAY_PUBLIC_URL, ``Host: evil.example.com`` gave
    ``Location: http://evil.example.com/v1/runs/…``."""
    token = relay.tokens["beta"]
    for wait in (True, False):
        body = {"job": "echo", "params": {"message": "x"}, "wait": wait}
        answer = relay.post(token, body, Host="evil.example.com")
        assert answer.status_code in (200, 202), answer.text
        run_id = answer.json()["id"]
        assert answer.headers["location"] == f"/v1/runs/{run_id}"
        assert "evil" not in answer.text
        followed = relay.get(token, answer.headers["location"])  # relative: same server
        assert followed.json()["id"] == run_id


def test_the_sandbox_sees_only_its_own_names_and_memory(relay: RelayProcess) -> None:
    code = """
        import json, socket
        print(json.dumps(open('/etc/hosts').read()))
        print(socket.gethostname())
        print(open('/proc/meminfo').readline().split()[1])
    """
    body = {"job": "python", "stdin": textwrap.dedent(code)}
    run = relay.post(relay.tokens["alpha"], body).json()
    assert run["state"] == "succeeded", run
    hosts, hostname, memory_kb = run["stdout"].splitlines()
    names = {name for line in json.loads(hosts).splitlines() for name in line.split()[1:]}
    assert names <= {"localhost", "sandbox", "ip6-localhost"}, hosts
    assert hostname == "sandbox" and hostname != os.uname().nodename
    assert int(memory_kb) == (MEMORY_MB + DISK_MB) * 1024  # its own limit, not the host's
