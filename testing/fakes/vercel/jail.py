"""How the fake runs a command "inside" a sandbox whose filesystem is a host directory.

With bubblewrap (when it works here), the sandbox directory *is* the command's ``/``:
host ``/usr`` and ``/etc`` are mounted read-only on top, so ``/workspace/x``, ``pwd`` and
paths inside shell scripts all mean what they mean on Vercel, the host's other files are
out of sight, and a ``deny-all`` network policy is enforced with a private network
namespace. Without it, the command runs on the host with its cwd mapped into the sandbox
directory and every absolute-path argument under a sandbox top-level directory rewritten
(paths inside shell scripts are then *not* mapped).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SANDBOX_TOPS = frozenset({"workspace", "vercel", "tmp"})
"""Top-level directories an argument is mapped into (without bubblewrap) before they exist."""
_HOST_LINKS = ("bin", "lib", "lib64", "sbin")
_MOUNT_POINTS = ("usr", "etc", "proc", "dev")


@functools.cache
def bwrap() -> str | None:
    """The bubblewrap binary, if it can build a root here; else None (path mapping)."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = [path, "--ro-bind", "/usr", "/usr", "--dev", "/dev", "--die-with-parent"]
    for name in _HOST_LINKS:
        host = Path("/", name)
        if host.is_symlink():
            probe += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            probe += ["--ro-bind", str(host), f"/{name}"]
    probe += ["--", "/usr/bin/true"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if done.returncode == 0 else None


def prepare_root(root: Path) -> None:
    """Mount points and the host's ``/bin``-style links, made once per sandbox."""
    if bwrap() is None:
        return
    for name in _MOUNT_POINTS:
        (root / name).mkdir(exist_ok=True)
    for name in _HOST_LINKS:
        host = Path("/", name)
        if host.is_symlink():
            (root / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (root / name).mkdir(exist_ok=True)


@dataclass(frozen=True)
class Launch:
    """What to hand to ``create_subprocess_exec``."""

    argv: list[str]
    cwd: Path | None
    home: str
    tmp: str


def host_path(root: Path, path: str, cwd: str = "/") -> Path:
    """Where a sandbox path lives on the host; refuses to leave the sandbox root."""
    sandbox_path = PurePosixPath("/", cwd, path)
    parts = [part for part in sandbox_path.parts[1:] if part not in ("", ".")]
    target = root.joinpath(*parts)
    # A job may plant symlinks; the fake (often root) must never follow one out of the box.
    if ".." in parts or not target.resolve().is_relative_to(root.resolve()):
        raise ValueError("path leaves the sandbox")
    return target


def _map_argument(root: Path, argument: str) -> str:
    if not argument.startswith("/") or ".." in PurePosixPath(argument).parts:
        return argument
    first = PurePosixPath(argument).parts[1:2]
    if first and (first[0] in SANDBOX_TOPS or (root / first[0]).exists()):
        return str(host_path(root, argument))
    return argument


def launch(
    root: Path, argv: list[str], cwd: str, *, isolate_network: bool, own_pids: bool = True
) -> Launch:
    """The host command line that runs ``argv`` at ``cwd`` in the sandbox at ``root``.

    ``own_pids``: the command gets a PID namespace of its own, so everything it started ends
    with it. Without one (a fake of a VM, whose processes outlive the command that started
    them) it sees the host's ``/proc``, read-only, and the fake ends its processes itself."""
    jail = bwrap()
    if jail is None:
        mapped = [argv[0], *(_map_argument(root, argument) for argument in argv[1:])]
        home = str(host_path(root, "/vercel/sandbox"))
        return Launch(mapped, host_path(root, cwd), home, str(host_path(root, "/tmp")))
    command = [jail, "--bind", str(root), "/", "--ro-bind", "/usr", "/usr"]
    command += ["--ro-bind", "/etc", "/etc", "--dev", "/dev"]
    command += ["--proc", "/proc"] if own_pids else ["--ro-bind", "/proc", "/proc"]
    for name in _HOST_LINKS:  # hosts without merged /usr have real /lib, /bin...
        if Path("/", name).is_dir() and not Path("/", name).is_symlink():
            command += ["--ro-bind", f"/{name}", f"/{name}"]
    command += ["--unshare-pid"] if own_pids else []
    command += ["--unshare-ipc", "--die-with-parent"]
    if isolate_network:
        command.append("--unshare-net")
    command += ["--chdir", cwd, "--", *argv]
    return Launch(command, None, "/vercel/sandbox", "/tmp")
