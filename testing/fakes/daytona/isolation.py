"""How the fake gives each sandbox its own ``/workspace``, ``/home/daytona`` and ``/tmp``.

As the E2B fake does: with bubblewrap (when it works here) a command sees the host's system
read-only and the sandbox's private directories mounted at those paths, in its own PID
namespace, without network when the sandbox blocks all of it. Without bubblewrap those
paths in the shell line are rewritten to the sandbox's directory (an approximation).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

MOUNTS = {"workspace": "/workspace", "home/daytona": "/home/daytona", "tmp": "/tmp"}
_SKIP = ("workspace", "home", "tmp", "proc", "dev", "sys")
_SANDBOX_PATH = re.compile(r"(?<![\w./-])(/workspace|/home/daytona|/tmp)(?=[/\s'\"]|$)")


def _bwrap(root: Path, cwd: str, *, network: bool) -> list[str]:
    args = ["bwrap", "--tmpfs", "/"]
    for entry in sorted(Path("/").iterdir()):
        if entry.name in _SKIP:
            continue
        if entry.is_symlink():
            args += ["--symlink", str(entry.readlink()), str(entry)]
        elif entry.exists():
            args += ["--ro-bind", str(entry), str(entry)]
    args += ["--dev", "/dev", "--proc", "/proc"]
    for inside, path in MOUNTS.items():
        args += ["--bind", str(root / inside), path]
    args += ["--unshare-pid", "--die-with-parent", "--chdir", cwd]
    if not network:
        args.append("--unshare-net")
    return args


@functools.cache
def bwrap_works() -> bool:
    """Whether bubblewrap can build the sandbox view on this machine."""
    if shutil.which("bwrap") is None:
        return False
    with tempfile.TemporaryDirectory() as root:
        for inside in MOUNTS:
            Path(root, inside).mkdir(parents=True)
        try:
            done = subprocess.run(
                [*_bwrap(Path(root), "/workspace", network=False), "true"],
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


def launch(
    root: Path, line: str, cwd: str, *, isolate_network: bool
) -> tuple[list[str], Path | None]:
    """argv and host cwd (None when bubblewrap changes directory) for ``sh -c line``."""
    if bwrap_works():
        return [*_bwrap(root, cwd, network=not isolate_network), "sh", "-c", line], None
    mapped = _SANDBOX_PATH.sub(lambda m: f"{root}{m.group(1)}", line)
    return ["sh", "-c", mapped], root / cwd.lstrip("/")
