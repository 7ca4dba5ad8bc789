"""The local provider's sandbox root on the host: the root's checks, each sandbox's folder
(its ``tags.json`` and the ``lock`` held while it lives) and their removal, and the
processes of a sandbox found by its marker.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.errors import ConfigError
from relay.providers.contract import SANDBOX_MARKER
from relay.settings import Settings

LOCK_FILE = "lock"
TAGS_FILE = "tags.json"
ENDING_FILE = "ending"
"""Written first by a terminate, so a command killed by it (from this relay or another)
reads as a lost sandbox, not as the job's own exit 137."""


def sandbox_root(settings: Settings) -> Path:
    """``RELAY_LOCAL_ROOT``, else ``sandboxes`` in the relay's state directory."""
    if settings.local_root is not None:
        return settings.local_root
    return settings.state_directory() / "sandboxes"


def check_root(root: Path) -> None:
    """Create the sandbox root 0700, or refuse one the relay cannot trust as found."""
    try:
        found = root.lstat()
    except FileNotFoundError:
        try:
            root.mkdir(parents=True, mode=0o700)
        except OSError as exc:
            raise _unusable(root, exc) from None
        return
    except OSError as exc:  # a path through a file, a folder this user cannot search
        raise _unusable(root, exc) from None
    if not stat.S_ISDIR(found.st_mode):
        raise ConfigError(f"{root}: the local sandbox root (RELAY_LOCAL_ROOT) is not a folder")
    if found.st_uid != os.geteuid():
        raise ConfigError(
            f"{root}: the local sandbox root belongs to uid {found.st_uid}, not to the "
            f"relay's user (uid {os.geteuid()}); remove it or set RELAY_LOCAL_ROOT"
        )
    if found.st_mode & 0o077:
        raise ConfigError(
            f"{root}: the local sandbox root (RELAY_LOCAL_ROOT) has mode "
            f"{stat.S_IMODE(found.st_mode):04o}; "
            "it must allow no group or other access (chmod 700 it, or remove it)"
        )


def _unusable(root: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        f"RELAY_LOCAL_ROOT: cannot make or use the local sandbox root {root} "
        f"({exc.strerror}); set RELAY_LOCAL_ROOT (or RELAY_STATE_DIR) to a folder the relay "
        "can create"
    )


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def marked_pids(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's marker (setsid escapees)."""
    marker = f"{SANDBOX_MARKER}={sandbox_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def lock_held(home: Path) -> bool:
    """True while some relay (this one included) keeps the sandbox's lock, and when it
    cannot tell (out of file descriptors, a lock file it may not open): only a lock file
    that is gone, or that it could take, is free. A serving relay's reaper ends a sandbox
    whose lock is free (``abandoned``), so a doubt must keep it, not end a live run."""
    try:
        fd = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_home(home: Path) -> None:
    """Remove a sandbox's folder, its ``tags.json`` last, so a folder that could not be
    removed stays listed for the reaper. Unreadable folders (``chmod 000``) are opened up.
    What another remover (a replica's reaper ending the same sandbox) took first is gone
    already: not a failure, so neither leaves the other's half-removed folder behind."""

    def opened_up(function: Callable[..., object], path: str, exc: Any) -> None:
        if isinstance(exc[1], FileNotFoundError):
            return
        os.chmod(os.path.dirname(path) or ".", 0o700)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        function(path)

    try:
        entries = list(home.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name == TAGS_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, onerror=opened_up)
        else:
            entry.unlink(missing_ok=True)
    (home / TAGS_FILE).unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        home.rmdir()
