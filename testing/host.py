"""What a test takes of the host it shares with others: another copy of the suite (from
another clone) may run beside it, and a run killed outright leaves processes and the relays
it started behind. So nothing here is a fixed number another run may use at the same time.

- :func:`sleep_marker`: a duration for ``sleep`` that no other process on the host sleeps,
  by which a test finds its own job's process in the process table (and no other run's);
- :func:`uid_range`: host uids for a root relay's local sandboxes (``RELAY_LOCAL_UIDS``)
  that no other test process on the host is given while this one lives.
"""

from __future__ import annotations

import errno
import secrets
import socket

SUITE_UIDS = (710_000_000, 729_999_999)
"""The uids the suite's own ranges are cut from: outside the relay's default range
(``RELAY_LOCAL_UIDS``, 700000000-700065535), which relays the tests start share as relays do."""
BLOCK = 1000
"""The uids of one :func:`uid_range`, at most."""

_reserved: list[socket.socket] = []
"""The locks of this process's blocks: held until it ends."""


def sleep_marker(seconds: int) -> str:
    """``seconds`` and a random fraction, as ``sleep`` takes it: a duration no other
    process on this host sleeps (another test, another copy of the suite, a sandbox a
    killed run left running)."""
    return f"{seconds}.{secrets.randbelow(10**8):08d}"


def uid_range(size: int = BLOCK) -> tuple[int, int]:
    """``(first, last)``: ``size`` uids of this process's own, cut from :data:`SUITE_UIDS`.

    The block is held by an abstract unix socket named after it, as a relay holds a
    sandbox's uid (relay/providers/local/uids.py): no other process on the host gets it
    while this one lives, and it is let go when the process ends, also when it is killed
    (nothing is left behind). A block is drawn at random, so what a killed run left running
    as one of its uids (a stray ``setpriv`` process, a sandbox) is almost never met."""
    if not 0 < size <= BLOCK:
        raise ValueError(f"a range of 1 to {BLOCK} uids, not {size}")
    blocks = (SUITE_UIDS[1] - SUITE_UIDS[0] + 1) // BLOCK
    for _ in range(100):
        first = SUITE_UIDS[0] + secrets.randbelow(blocks) * BLOCK
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            lock.bind(b"\0relay-test-uids-%d" % first)
        except OSError as exc:
            lock.close()
            if exc.errno == errno.EADDRINUSE:
                continue  # another test process's
            raise
        _reserved.append(lock)
        return first, first + size - 1
    raise RuntimeError("no free block of test uids after 100 draws")
