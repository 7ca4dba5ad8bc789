"""The local sandboxes' share of the host's open-file table (``fs.file-max``).

Past ``fs.file-max`` every process without ``CAP_SYS_ADMIN`` gets "Too many open files in
system": the relay deployed as its own user, its database, everything else on the host.
Neither the memory limit nor the process limit stops a job from opening files (a struct
file is a few hundred bytes), so the relay bounds the product: a sandbox holds at most
``RELAY_LOCAL_PIDS_MAX`` processes (the cgroup's ``pids.max``, else ``RLIMIT_NPROC``) of
``RELAY_LOCAL_OPEN_FILES`` each (``RLIMIT_NOFILE``), and the relay runs a command in at
most ``RELAY_LOCAL_MAX_SANDBOXES`` sandboxes at once (and never more than
``RELAY_MAX_CONCURRENT`` runs; a sandbox waiting in a pool holds no process).
:func:`fit` keeps that product at :data:`SHARE` of ``fs.file-max`` or less: when the
settings pass it, the open files (down to :data:`MIN_OPEN_FILES`), then the processes (down
to :data:`MIN_PIDS`) of each sandbox are lowered, with one line saying so; where even that
is too much, the relay refuses to start.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from relay.errors import ConfigError

FILE_MAX = Path("/proc/sys/fs/file-max")
SHARE = 0.25
"""The part of the host's file table all local sandboxes together may fill: when every one
of them holds all it may, three quarters stay for the host."""
MIN_OPEN_FILES = 64
MIN_PIDS = 16


@dataclass(frozen=True)
class FileBudget:
    """Each sandbox's processes and open files per process, and why they were lowered."""

    pids: int
    open_files: int
    lowered: str | None = None


def file_max(path: Path = FILE_MAX) -> int | None:
    """``fs.file-max``, or ``None`` when it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


def fit(limit: int | None, sandboxes: int, pids: int, open_files: int) -> FileBudget:
    """The per-sandbox numbers that keep ``sandboxes`` x processes x open files within
    :data:`SHARE` of ``limit`` (``fs.file-max``; ``None``: unknown, taken as it is)."""
    if limit is None:
        return FileBudget(pids, open_files)
    allowed = int(limit * SHARE) // sandboxes
    if pids * open_files <= allowed:
        return FileBudget(pids, open_files)
    fitted_files = max(min(open_files, MIN_OPEN_FILES), allowed // pids)
    fitted_pids = pids
    if fitted_pids * fitted_files > allowed:
        fitted_pids = max(min(pids, MIN_PIDS), allowed // fitted_files)
    wanted = sandboxes * pids * open_files
    if fitted_pids * fitted_files > allowed:
        raise ConfigError(
            f"RELAY_LOCAL_MAX_SANDBOXES: {sandboxes} local sandboxes of even {fitted_pids} "
            f"processes x {fitted_files} open files could hold "
            f"{sandboxes * fitted_pids * fitted_files:,} files, more than a quarter of this "
            f"host's fs.file-max ({limit:,}); lower RELAY_LOCAL_MAX_SANDBOXES (or "
            "RELAY_MAX_CONCURRENT)"
        )
    return FileBudget(
        fitted_pids,
        fitted_files,
        f"local provider: {sandboxes} sandboxes x {pids} processes x {open_files} open files "
        f"could hold {wanted:,} files, more than a quarter of this host's fs.file-max "
        f"({limit:,}); each sandbox gets {fitted_pids} processes of {fitted_files} open files",
    )
