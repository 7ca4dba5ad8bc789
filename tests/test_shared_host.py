"""The test kit's numbers of the shared host (testing/host.py): what one copy of the suite
takes, another copy beside it (another clone) never gets, and a killed run leaves nothing."""

from __future__ import annotations

import contextlib
import itertools
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from testing import host
from testing.settings import REPO

HOLD_A_BLOCK = """
import sys, time
from testing.host import uid_range
print(uid_range()[0], flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _holder() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process of the suite (another worker, another clone's run) and its block;
    killed on exit."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_A_BLOCK], cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            yield process, int(process.stdout.readline())
        finally:
            process.kill()


def test_a_block_another_process_holds_is_never_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    with _holder() as (_, theirs):
        # Every draw lands on their block first: it is passed over for the next one.
        blocks = (host.SUITE_UIDS[1] - host.SUITE_UIDS[0] + 1) // host.BLOCK
        index = (theirs - host.SUITE_UIDS[0]) // host.BLOCK
        draws = itertools.chain([index, index], ((index + n) % blocks for n in itertools.count(1)))
        monkeypatch.setattr(secrets, "randbelow", lambda _: next(draws))
        first, last = host.uid_range(16)
        assert first != theirs and last == first + 15
        assert (first - theirs) % (blocks * host.BLOCK) == host.BLOCK  # the next block
        assert host.SUITE_UIDS[0] <= theirs and last <= host.SUITE_UIDS[1]
        assert not 700_000_000 <= first <= 700_065_535  # the relay's default range


def test_a_killed_processs_block_is_free_again_at_once() -> None:
    with _holder() as (holder, theirs):
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as lock:
        lock.bind(b"\0relay-test-uids-%d" % theirs)  # nothing of it was left behind


def test_a_sleep_marker_is_a_duration_sleep_takes_and_no_other_run_sleeps() -> None:
    markers = {host.sleep_marker(0) for _ in range(50)}
    assert len(markers) == 50
    started = time.monotonic()
    for marker in list(markers)[:3]:
        assert subprocess.run(["sleep", marker], check=False).returncode == 0
    assert time.monotonic() - started < 5
