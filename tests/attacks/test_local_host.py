"""Attacks on the host through the ``local`` provider (issue 17, items 1-5 and 9), against a
real ``relay serve`` with bubblewrap and tiny limits: nothing of a request reaches the
host, and every sandbox is bounded in memory, processes, CPU and disk."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from relay.providers.local import cgroups
from relay.providers.local.invocation import bwrap_blocks_userns, bwrap_works
from testing.host import sleep_marker
from testing.relay_server import RelayProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working"),
]

MEMORY_MB, DISK_MB, PIDS = 64, 16, 32
LIMITS = {
    "local_isolation": "bwrap",
    "local_max_memory_mb": MEMORY_MB,
    "local_max_disk_mb": DISK_MB,
    "local_pids_max": PIDS,
}
PRELOAD_SOURCE = """
#include <stdio.h>
static void mark(void) __attribute__((constructor));
static void mark(void) { FILE *f = fopen("%s", "a"); if (f) { fputs("ran\\n", f); fclose(f); } }
unsigned int la_version(unsigned int version) { return version; }
"""


def _cgroups_v1() -> bool:
    return Path("/sys/fs/cgroup/memory/cgroup.procs").exists() and os.access(
        "/sys/fs/cgroup/memory", os.W_OK
    )


needs_cgroups = pytest.mark.skipif(not _cgroups_v1(), reason="no writable cgroup v1 here")


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(tmp_path_factory.mktemp("attacked"), **LIMITS)
    server.add_token("jobs", jobs=["python", "echo"])
    server.add_token("commands", command=True)
    server.start()
    yield server
    server.stop()


def _python(relay: RelayProcess, code: str, **extra: Any) -> dict[str, Any]:
    body = {"job": "python", "stdin": textwrap.dedent(code), **extra}
    answer = relay.post(relay.tokens["jobs"], body)
    assert answer.status_code == 200, answer.text
    run: dict[str, Any] = answer.json()
    return run


def _marker_library(tmp_path: Path, marker: Path) -> Path | None:
    """A shared library whose constructor appends to ``marker`` (None without gcc)."""
    if shutil.which("gcc") is None:
        return None
    source = tmp_path / "mark.c"
    source.write_text(PRELOAD_SOURCE % marker)
    library = tmp_path / "libmark.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", library, source], check=True)
    return library


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "LD_DEBUG"])
@pytest.mark.parametrize("route", ["job", "command"])
def test_loader_variables_create_and_run_nothing_on_the_host(
    relay: RelayProcess, tmp_path: Path, variable: str, route: str
) -> None:
    marker = tmp_path / "ran-on-host"
    debug_log = tmp_path / "loader-debug"
    library = _marker_library(tmp_path, marker)
    env = {"LD_DEBUG": "libs", "LD_DEBUG_OUTPUT": str(debug_log)}
    if variable in ("LD_PRELOAD", "LD_AUDIT") and library is not None:
        env[variable] = str(library)
    elif variable == "LD_LIBRARY_PATH":
        env[variable] = str(tmp_path)
    if route == "job":
        run = _python(relay, "print('done')", env=env)
    else:
        body = {"command": ["echo", "done"], "env": env}
        run = relay.post(relay.tokens["commands"], body).json()
    assert run["state"] == "succeeded", run
    assert not marker.exists(), "a request's library ran on the host"
    assert not list(tmp_path.glob("loader-debug*")), "a request's loader output hit the host"


def test_the_sandbox_sees_no_host_path(relay: RelayProcess) -> None:
    run = _python(
        relay,
        """
        print(open('/proc/1/cmdline').read().replace('\\0', ' '))
        print(open('/proc/self/mountinfo').read())
        """,
    )
    assert run["state"] == "succeeded", run
    assert "bwrap --args" in run["stdout"]
    assert str(relay.root) not in run["stdout"]  # the sandbox root and the relay's folder


@pytest.mark.skipif(
    shutil.which("bwrap") is None or not bwrap_blocks_userns(shutil.which("bwrap") or "bwrap"),
    reason="this bubblewrap has no --disable-userns",
)
def test_a_job_cannot_make_namespaces_of_its_own(relay: RelayProcess) -> None:
    """A user namespace of its own made the job root there, with every capability over
    the network and mount namespaces it then made: nftables and mounts, kernel code that
    unprivileged escapes go through."""
    tries = "unshare -Ur true && echo user; unshare -Urn true && echo net; echo end"
    answer = relay.post(relay.tokens["commands"], {"command": ["sh", "-c", tries]})
    run = answer.json()
    assert run["state"] == "succeeded" and run["stdout"] == "end\n", run


@pytest.mark.skipif(os.geteuid() != 0, reason="only a relay running as root maps to root")
def test_a_sandbox_of_a_root_relay_is_not_root_on_the_host(relay: RelayProcess) -> None:
    """bubblewrap maps the sandbox's user to the user that starts it: a relay running as
    root must start it as a uid of the sandbox's own, or an escaped job would be the
    host's root."""
    marker = sleep_marker(3)
    body = {"command": ["sleep", marker]}
    answer: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: answer.update(relay.post(relay.tokens["commands"], body).json())
    )
    waiter.start()
    try:
        uids: set[int] = set()
        deadline = time.monotonic() + 5
        while not uids and time.monotonic() < deadline:
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                        uids.add(entry.stat().st_uid)
                except OSError:
                    continue
            time.sleep(0.05)
        assert uids, "the job's process was not found on the host"
        assert 0 not in uids, "the sandbox's processes run as the host's root"
    finally:
        waiter.join(15)
    assert answer.get("state") == "succeeded", answer


@needs_cgroups
def test_a_job_past_its_memory_ends_out_of_memory_and_the_relay_lives(
    relay: RelayProcess,
) -> None:
    run = _python(relay, "b = bytearray(150 * 1024 * 1024)\nprint('survived')")
    assert run["state"] == "failed", run
    assert run["error"]["code"] == "out_of_memory"
    assert "survived" not in run["stdout"]
    assert httpx.get(relay.url + "/healthz", timeout=5).status_code == 200


@needs_cgroups
def test_tmpfs_pages_count_against_the_memory_limit(relay: RelayProcess) -> None:
    # Each mount alone is within the disk cap; with 40 MiB of memory they pass 64 + 16 MiB.
    run = _python(
        relay,
        f"""
        for path in ('/dev/shm/fill', '/tmp/fill', '/workspace/fill'):
            with open(path, 'wb') as out:
                out.write(b'x' * ({DISK_MB} - 1) * 1024 * 1024)
        try:
            open('/fill', 'wb')
        except OSError as exc:
            print('root', exc.strerror, flush=True)
        b = bytearray(40 * 1024 * 1024)
        print('survived')
        """,
    )
    assert run["state"] == "failed", run
    assert run["error"]["code"] == "out_of_memory"
    assert "root Read-only file system" in run["stdout"]


FORKS = """
import os, time
forked = 0
try:
    while forked < 200:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        forked += 1
except OSError as exc:
    print('stopped', forked)
"""


@needs_cgroups
def test_a_fork_bomb_is_bounded_and_others_still_run(relay: RelayProcess) -> None:
    results: dict[str, Any] = {}

    def bomb() -> None:
        results["bomb"] = _python(relay, FORKS, timeout_s=4)

    thread = threading.Thread(target=bomb)
    thread.start()
    time.sleep(0.5)
    other = relay.post(relay.tokens["jobs"], {"job": "echo", "params": {"message": "hi"}})
    thread.join(30)
    assert other.json()["state"] == "succeeded", other.text
    assert "stopped" in results["bomb"]["stdout"], results["bomb"]
    assert int(results["bomb"]["stdout"].split()[-1]) < PIDS


def test_a_job_cannot_fill_the_hosts_file_table(relay: RelayProcess) -> None:
    """Each process inherited the relay's open-file limit (raised for its connections):
    with its processes a job could hold millions of files, past the host's fs.file-max."""
    run = _python(
        relay,
        """
        import os, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        opened = []
        try:
            while len(opened) < 100_000:
                opened.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print(hard, len(opened))
        """,
    )
    hard, opened = map(int, run["stdout"].split())
    assert hard <= 128 and opened < 128, run  # RELAY_LOCAL_OPEN_FILES, by default


@needs_cgroups
def test_a_one_vcpu_job_gets_one_core(relay: RelayProcess) -> None:
    run = _python(
        relay,
        """
        import os, time
        end = time.monotonic() + 1.5
        started = time.monotonic()
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                while time.monotonic() < end:
                    pass
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        used = os.times()
        print((used.children_user + used.children_system) / (time.monotonic() - started))
        """,
    )
    assert run["state"] == "succeeded", run
    assert float(run["stdout"]) <= 1.2


def test_disk_is_capped_and_nothing_of_the_sandbox_remains(relay: RelayProcess) -> None:
    run = _python(
        relay,
        """
        import os
        os.makedirs('locked/deep')
        try:
            with open('locked/deep/big', 'wb') as out:
                for _ in range(64):
                    out.write(b'x' * 1024 * 1024)
        except OSError as exc:
            print(exc.strerror)
        os.chmod('locked/deep', 0)
        os.chmod('locked', 0)
        """,
    )
    assert run["state"] == "succeeded", run
    assert "No space left on device" in run["stdout"]
    assert list((relay.root / "sandboxes").iterdir()) == []


@pytest.mark.parametrize("how", ["world-writable", "foreign-owned"])
def test_an_untrusted_sandbox_root_stops_the_relay(tmp_path: Path, how: str) -> None:
    server = RelayProcess(tmp_path / "relay", local_isolation="bwrap")
    server.add_token("ops", jobs=["echo"])
    root = tmp_path / "relay" / "sandboxes"
    root.mkdir(mode=0o700)
    if how == "world-writable":
        root.chmod(0o777)
    else:
        os.chown(root, 65534, 65534)
    with pytest.raises(RuntimeError, match="relay exited at start"):
        server.start()
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert len(lines) == 1 and str(root) in lines[0], lines
    assert server.process is not None and server.process.returncode != 0


@needs_cgroups
def test_leftover_groups_are_killed_at_start_and_readyz_needs_the_root(tmp_path: Path) -> None:
    server = RelayProcess(tmp_path / "relay", **LIMITS)
    server.add_token("ops", jobs=["echo"])
    root = tmp_path / "relay" / "sandboxes"
    root.mkdir(mode=0o700)
    home = root / "lcl-leftover-000000"  # an earlier relay's: its lock is not held
    home.mkdir(mode=0o700)
    (home / "lock").touch()
    tree, _ = cgroups.detect(root)
    assert tree is not None
    group = tree.create(home.name, cgroups.GroupLimits(64 << 20, 8, 1.0))
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        group.add(stray.pid)
        server.start()
        assert stray.wait(10) == -signal.SIGKILL
        assert not group.exists
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200
        shutil.rmtree(root)
        answer = httpx.get(server.url + "/readyz", timeout=5)
        assert answer.status_code == 503
        assert json.loads(answer.text)["checks"]["local"] == "the sandbox root is gone"
    finally:
        stray.kill()
        stray.wait()
        server.stop()
        if group.exists:
            group.remove()


@needs_cgroups
def test_providers_show_the_limits_in_force(relay: RelayProcess) -> None:
    answer = relay.get(relay.tokens["jobs"], "/v1/providers").json()
    [local] = [p for p in answer["providers"] if p["name"] == "local"]
    assert local["limits"] == {
        "isolation": "bwrap",
        "cgroup": "v1",
        "memory": True,
        "pids": True,
        "cpu": True,
        "disk": True,
        "uid": "per-sandbox" if os.geteuid() == 0 else "relay",
    }


def test_the_sandbox_sees_its_own_accounts_not_the_hosts(relay: RelayProcess) -> None:
    run = _python(
        relay,
        """
        for name in ('passwd', 'group'):
            print(sorted(line.split(':')[0] for line in open('/etc/' + name) if line.strip()))
        print(open('/proc/self/oom_score_adj').read().strip())
        """,
    )
    assert run["state"] == "succeeded", run
    users, groups, oom_score = run["stdout"].splitlines()
    assert users == "['nobody', 'root']"
    assert groups == "['nogroup', 'root']"
    assert oom_score == "1000"  # out of memory, the kernel takes a sandbox before the relay


async def test_a_job_cannot_stop_its_hard_deadline(tmp_path: Path) -> None:
    """The sandbox's own lifetime (``timeout -s KILL``) is kept outside bubblewrap, where
    the job cannot reach it: stopping its parent used to stop the clock."""
    from relay.providers.contract import OutputSink, SandboxSpec
    from relay.providers.local.provider import LocalProvider
    from tests.conftest import make_settings

    provider = LocalProvider(make_settings(tmp_path, local_isolation="bwrap"))
    spec = SandboxSpec(run_id="run_deadline", cluster="test", timeout_s=1, grace_s=0)
    started = time.monotonic()
    try:
        async with asyncio.timeout(15), provider.sandbox(spec) as box:
            result = await box.exec(
                ["sh", "-c", "kill -STOP $PPID; sleep 20"],
                stdin=None,
                env={},
                workdir=None,
                timeout_s=60,
                output=OutputSink(1024),
            )
    finally:
        await provider.aclose()
    assert time.monotonic() - started < 8, "the job outlived its sandbox's lifetime"
    assert result.exit_code == 137
