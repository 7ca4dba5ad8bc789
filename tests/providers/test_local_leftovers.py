"""What a dead relay left of its local sandboxes (a group whose lock nobody holds): `relay
reap --dry-run` names it and leaves every process and group as found; `relay reap` ends it
and says so. Real processes in real cgroup v1 groups, the real command in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.providers.contract import TAG_CLUSTER, TAG_RUN
from relay.providers.local import cgroups
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.root import LOCK_FILE, TAGS_FILE

pytestmark = [
    pytest.mark.slow,  # two `python -m relay` processes
    pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working"),
    pytest.mark.skipif(
        not os.access("/sys/fs/cgroup/memory/cgroup.procs", os.W_OK),
        reason="no writable cgroup v1 here",
    ),
]


def _reap(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "RELAY_DATABASE_URL": f"sqlite:///{tmp_path / 'relay.db'}",
        "RELAY_LOCAL_ROOT": str(tmp_path / "sandboxes"),
        "RELAY_LOCAL_ISOLATION": "bwrap",
        "RELAY_PROVIDERS": "local",
        "RELAY_CLUSTER": "leftovers",
    }
    return subprocess.run(
        [sys.executable, "-m", "relay", "reap", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_reap_dry_run_leaves_a_dead_relays_sandbox_running_and_reap_ends_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir(mode=0o700)
    # A sandbox of a relay killed outright: its folder (tags, a lock nobody holds) and its
    # group with a process in it; and a group whose folder is gone already.
    home = root / "lcl-dead-000000"
    home.mkdir(mode=0o700)
    (home / LOCK_FILE).touch()
    tags = {TAG_CLUSTER: "leftovers", TAG_RUN: "run_dead", "created_at": time.time()}
    (home / TAGS_FILE).write_text(json.dumps(tags))
    tree, reason = cgroups.detect(root)
    assert tree is not None, reason
    limits = cgroups.GroupLimits(64 << 20, 8, 1.0)
    groups = {name: tree.create(name, limits) for name in (home.name, "lcl-bare-000000")}
    strays = {
        name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        for name in groups
    }
    try:
        for name, group in groups.items():
            group.add(strays[name].pid)

        looked = _reap(tmp_path, "--dry-run")
        assert looked.returncode == 0, looked.stderr
        for name, group in groups.items():
            assert f"would terminate local {name}\n" in looked.stdout, looked.stdout
            assert strays[name].poll() is None, f"--dry-run killed {name}'s process"
            assert group.exists
            assert str(strays[name].pid) in (group.folders["memory"] / "cgroup.procs").read_text()
        assert (home / TAGS_FILE).exists()

        done = _reap(tmp_path)
        assert done.returncode == 0, done.stderr
        for name, group in groups.items():
            assert f"terminated local {name}\n" in done.stdout, done.stdout
            assert strays[name].wait(10) == -signal.SIGKILL
            assert not group.exists
        assert not home.exists()
    finally:
        for stray in strays.values():
            stray.kill()
            stray.wait()
        for group in groups.values():
            if group.exists:
                group.remove()


async def test_a_live_relays_sandbox_is_never_listed_abandoned(tmp_path: Path) -> None:
    """Another relay on the root (`relay reap`, a probe) sees a sandbox whose relay lives as
    that relay's: its group is there, but so is the lock, and nothing ends it."""
    from relay.providers.contract import SandboxSpec
    from relay.providers.local.provider import LocalProvider
    from tests.conftest import make_settings

    settings = make_settings(tmp_path, local_isolation="bwrap")
    serving = LocalProvider(settings)
    reaping = LocalProvider.for_reaper(settings)
    try:
        async with serving.sandbox(SandboxSpec("run_live", "test", 30)) as box:
            assert box.group is not None and box.group.exists
            [ref] = await reaping.list_owned()
            assert (ref.sandbox_id, ref.run_id, ref.abandoned) == (box.id, "run_live", False)
        assert await reaping.list_owned() == []
    finally:
        await reaping.aclose()
        await serving.aclose()


async def test_a_live_sandbox_whose_lock_cannot_be_looked_at_is_not_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving relay's own reaper lists its groups every sweep and ends an `abandoned`
    one whatever its run says: a relay out of file descriptors for a moment (a cap's worth
    of connections, a sandbox's uploads in a thread) could not open a live sandbox's lock
    file, took that for a free lock, and its next sweep killed the healthy run."""
    import errno

    from relay.providers.contract import SandboxSpec
    from relay.providers.local.provider import LocalProvider
    from tests.conftest import make_settings

    opened = os.open

    def out_of_fds(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if Path(path).name == LOCK_FILE and not flags & os.O_CREAT:
            raise OSError(errno.EMFILE, "Too many open files")
        return opened(path, flags, *args)

    settings = make_settings(tmp_path, local_isolation="bwrap")
    serving = LocalProvider(settings)
    try:
        async with serving.sandbox(SandboxSpec("run_live", "test", 30)) as box:
            assert box.group is not None and box.group.exists
            with monkeypatch.context() as patched:
                patched.setattr(os, "open", out_of_fds)
                [ref] = await serving.list_owned()
            assert (ref.sandbox_id, ref.run_id, ref.abandoned) == (box.id, "run_live", False)
    finally:
        await serving.aclose()
