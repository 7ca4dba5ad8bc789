"""The host uids local sandboxes run as: one per sandbox, from a range the relay owns
(``RELAY_LOCAL_UIDS``), when the relay runs as root.

bubblewrap maps the sandbox's user (``nobody`` inside) to the user that starts it, so the
uid ``setpriv`` switches to before bubblewrap is the uid the host sees. It owns the
sandbox's ``/proc`` entries (its environment, its root and so its files), its per-user
kernel counts (``RLIMIT_NPROC``, inotify instances, keys) and whatever an escape would
reach. Shared with another process, that process may read a live sandbox's environment
and files and ptrace it: every sandbox of a root relay used to run as the host's
``nobody`` (65534), shared with the host's other ``nobody`` processes and with each other.

A uid is held by binding an abstract unix socket named after it (``relay-uid-N``): taken
or refused at once, by every relay on this host whatever its sandbox root (the names
belong to the network namespace, and no sandbox shares the relay's), and released when
the relay closes it or dies; no file is left behind. :func:`check_free` refuses at startup a
range that an account, a group or a subordinate range uses (a configuration fault), and
holds back the uids that running processes use outside any relay's sandbox: a leftover
sandbox of a relay killed outright, a process that outlived the sweep of its groups, or
another program. Such a uid is no reason to refuse the start (a job must not be able to
stop every restart), but no sandbox gets it while any process still runs as it: taking a
held-back uid looks again at the processes found with it (and, once they are gone, at the
whole process table for that uid alone).

A relay that is not root cannot switch uid: its sandboxes run as its own uid (the kernel
lets an unprivileged user map only itself into a user namespace; mapping others takes the
setuid ``newuidmap`` and ``/etc/subuid``, which the shipped containers'
``no-new-privileges`` refuses). Then the relay's user is the sandboxes' dedicated uid:
:func:`shared_own_uid` names the other processes that use it, for a warning at startup.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from relay.errors import ConfigError, ProviderRateLimited

log = logging.getLogger("relay.providers.local")

SUBORDINATE_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))
"""Ranges given to users to map into their user namespaces: their processes may run as
any uid listed."""


def _name(uid: int) -> bytes:
    return b"\0relay-uid-%d" % uid


@dataclass
class HeldUid:
    """A uid this relay holds for one sandbox (its gid is the same number)."""

    uid: int
    _lock: socket.socket

    def release(self) -> None:
        self._lock.close()


def _hold(uid: int) -> socket.socket | None:
    """The lock of ``uid``, or ``None`` when some relay on this host holds it."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        lock.bind(_name(uid))
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return lock


class UidRange:
    """The uids ``first..last`` (inclusive), handed out one per sandbox."""

    def __init__(self, first: int, last: int) -> None:
        self.first = first
        self.size = last - first + 1
        # Where this relay starts looking: relays sharing a range rarely try the same uid.
        self._next = secrets.randbelow(self.size)
        self.held_back: dict[int, set[int]] = {}
        """Uids running processes use outside any relay's sandbox, with those processes'
        pids (:func:`check_free`): none is taken while any process runs as it."""

    @property
    def last(self) -> int:
        return self.first + self.size - 1

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def take(self) -> HeldUid:
        """A uid no other sandbox on this host holds; a bind per uid tried (the next one
        free is almost always the first tried)."""
        for _ in range(self.size):
            uid = self.first + self._next
            self._next = (self._next + 1) % self.size
            if uid in self.held_back and self._still_used(uid):
                continue
            lock = _hold(uid)
            if lock is not None:
                return HeldUid(uid, lock)
        raise ProviderRateLimited(
            "every uid of the local provider's range is in use", retry_after=5.0
        )

    def _still_used(self, uid: int) -> bool:
        """Whether a held-back uid still has a process: those found with it first (a few
        reads), then, once they are gone, every process (it may have started others)."""
        known = self.held_back[uid]
        if any(uid in _ids_of(pid) for pid in known):
            return True
        users = _users(lambda found: found == uid).get(uid, set())
        if users:
            self.held_back[uid] = users
            return True
        del self.held_back[uid]
        log.info("local provider: uid %d is no longer used by any process; sandboxes get it", uid)
        return False


def _process_ids(status: str, fields: tuple[str, ...]) -> set[int]:
    """The real, effective, saved and file-system ids of the ``status`` lines named."""
    found: set[int] = set()
    for line in status.splitlines():
        if line.startswith(fields):
            found.update(int(value) for value in line.split()[1:])
    return found


def _ids_of(pid: int) -> set[int]:
    """The uids and gids of a live process (not a zombie), empty when it is gone."""
    with contextlib.suppress(OSError, ValueError):
        status = Path(f"/proc/{pid}/status").read_text()
        if "\nState:\tZ" not in status and "\nState:\tX" not in status:
            return _process_ids(status, ("Uid:", "Gid:"))
    return set()


def _processes(fields: tuple[str, ...] = ("Uid:", "Gid:")) -> Iterator[tuple[int, set[int]]]:
    """Each process on the host (as far as this relay sees) with its ids."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                yield int(entry.name), _process_ids((entry / "status").read_text(), fields)


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return "?"


def _subordinate_overlap(uids: UidRange) -> str | None:
    for path in SUBORDINATE_FILES:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                owner, _, rest = line.partition(":")
                start, _, count = rest.partition(":")
                if not (start.strip().isdigit() and count.strip().isdigit()):
                    continue
                first, size = int(start), int(count)
                if first <= uids.last and first + size - 1 >= uids.first:
                    return f"{path} gives {owner} {first}-{first + size - 1}"
    return None


def check_free(uids: UidRange) -> None:
    """Refuse a range that an account, a group or a subordinate range uses
    (``ConfigError``, one line); hold back (:attr:`UidRange.held_back`) the uids that
    running processes other than a relay's sandboxes use, saying so in one line."""
    fix = "set RELAY_LOCAL_UIDS to a range nothing else on this host uses"
    for account in pwd.getpwall():
        if account.pw_uid in uids:
            raise ConfigError(
                f"RELAY_LOCAL_UIDS: uid {account.pw_uid} is the account {account.pw_name!r}; {fix}"
            )
    for group in grp.getgrall():
        if group.gr_gid in uids:
            raise ConfigError(
                f"RELAY_LOCAL_UIDS: gid {group.gr_gid} is the group {group.gr_name!r}; {fix}"
            )
    overlap = _subordinate_overlap(uids)
    if overlap is not None:
        raise ConfigError(f"RELAY_LOCAL_UIDS overlaps a subordinate range ({overlap}); {fix}")
    # A sandbox of a relay that just died is dying too (its ties kill it): looked at again
    # for a moment before it counts.
    found = _foreign(uids)
    for _ in range(_SETTLE_ROUNDS):
        if not found:
            return
        time.sleep(_SETTLE_S)
        found = _foreign(uids)
    if not found:
        return
    uids.held_back = found
    pids = sorted(pid for users in found.values() for pid in users)
    named = ", ".join(f"{pid} ({_command(pid)})" for pid in pids[:3])
    log.warning(
        "local provider: %d uid(s) of RELAY_LOCAL_UIDS (%s) run %d process(es) that are no "
        "relay's sandbox, such as %s (a sandbox a killed relay left, or another program); "
        "no sandbox gets those uids while any process runs as them",
        len(found),
        ", ".join(str(uid) for uid in sorted(found)[:3]) + (", …" if len(found) > 3 else ""),
        len(pids),
        named,
    )


_SETTLE_ROUNDS, _SETTLE_S = 20, 0.05


def _users(wanted: Callable[[int], bool]) -> dict[int, set[int]]:
    """The live processes (not zombies) running as each ``wanted`` uid, by uid."""
    users: dict[int, set[int]] = {}
    for pid, ids in _processes():
        matching = [uid for uid in ids if wanted(uid)]
        if matching and _ids_of(pid):  # a zombie's status names its ids still
            for uid in matching:
                users.setdefault(uid, set()).add(pid)
    return users


def _foreign(uids: UidRange) -> dict[int, set[int]]:
    """The processes running as a uid of ``uids`` that no relay holds, by uid."""
    found = _users(lambda uid: uid in uids)
    for uid in list(found):
        lock = _hold(uid)
        if lock is None:
            del found[uid]  # a sandbox of a relay on this host (another replica, a probe)
        else:
            lock.close()
    return found


def shared_own_uid() -> list[str]:
    """The other processes running as this relay's own uid (not the relay itself), as
    ``pid (command)``: they share its unprivileged sandboxes' uid."""
    own, me = os.geteuid(), os.getpid()
    return [
        f"{pid} ({_command(pid)})"
        for pid, uids in _processes(("Uid:",))
        if pid != me and own in uids
    ]


def for_sandboxes(bounds: tuple[int, int], sandboxes: int) -> UidRange | None:
    """A root relay's range of sandbox uids (``RELAY_LOCAL_UIDS``), checked free at
    startup; ``None`` for a relay that is not root, whose sandboxes run as its own uid
    (a warning names the other processes that share it)."""
    if os.geteuid() != 0:
        others = shared_own_uid()
        if others:
            log.warning(
                "local provider: sandboxes run as the relay's own uid %d (it is not root), "
                "which %d other process(es) here use, such as %s: they may read a live "
                "sandbox's environment and files; run the relay as a user of its own "
                "(deploy/), or as root for a uid per sandbox",
                os.geteuid(),
                len(others),
                ", ".join(others[:3]),
            )
        return None
    found = UidRange(*bounds)
    if found.size < sandboxes:
        raise ConfigError(
            f"RELAY_LOCAL_UIDS holds {found.size} uids, fewer than the {sandboxes} "
            "sandboxes this relay may hold at once (RELAY_LOCAL_MAX_SANDBOXES, and "
            "RELAY_POOL_MAX pooled)"
        )
    check_free(found)
    return found
