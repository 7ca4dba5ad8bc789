"""No local sandbox outlives a relay killed while it creates it (issue 37, item 3).

A relay killed outright mid-creation left sandboxes running until their hard lifetime when
no relay came back: its child could be reparented before it tied itself to the relay, and
bubblewrap read the relay's death as its release, left the process group ``timeout``
kills, and only then tied its child to itself; and bubblewrap, writing its child's pid to
the dead relay, died of SIGPIPE before the relay's death reached ``timeout``, leaving its
child waiting for it forever. ``testing/creation_kills.py`` kills relays
at seeded random moments of their creations; nothing restarts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.providers.contract import SANDBOX_MARKER
from relay.providers.local.invocation import bwrap_works
from relay.providers.local.provider import LocalProvider
from testing.host import uid_range
from testing.settings import REPO, make_settings

KILLS = 30
UIDS = uid_range()
"""A uid range of this run's own: other tests start processes as uids of theirs, and another
run of this test (another worktree) uses a range of its own."""
SETTLE_S = 20.0
"""What is tied to a killed relay is gone in milliseconds; waited for until it is gone, at
most this long (a busy machine schedules the deathwatch late)."""


def _left(prefix: str) -> list[str]:
    """Live processes (not zombies) of this test's sandboxes: by the marker every host-side
    process and job of a sandbox carries, or, as root, by the sandboxes' uid range."""
    marker = f"{SANDBOX_MARKER}=lcl-{prefix}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "comm").read_text().strip()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        ours = any(value.startswith(marker) for value in environ)
        if state not in ("Z", "X") and (ours or UIDS[0] <= uid <= UIDS[1]):
            found.append(f"{entry.name} ({command})")
    return found


@pytest.mark.slow
@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap missing or not working")
def test_relays_killed_mid_creation_leave_no_sandbox_process(tmp_path: Path) -> None:
    prefix = secrets.token_hex(3)
    root = tmp_path / "sandboxes"
    harness = [sys.executable, "-m", "testing.creation_kills", str(root), "37", str(KILLS)]
    harness += [prefix, f"{UIDS[0]}-{UIDS[1]}"]
    try:
        done = subprocess.run(harness, cwd=REPO, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("killed relay") == KILLS
        deadline = time.monotonic() + SETTLE_S
        while (left := _left(prefix)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], f"sandbox processes outlived {KILLS} killed relays"
    finally:
        for process in _left(prefix):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(process.split()[0]), signal.SIGKILL)
        # What a restarted relay would do: its leftover groups and uids swept.
        provider = LocalProvider(
            make_settings(tmp_path, local_isolation="bwrap", local_root=root, local_uids=UIDS)
        )
        asyncio.run(provider.aclose())
