"""How the fake gives each sandbox its own ``/workspace``, ``/home/user`` and ``/tmp``.

With bubblewrap (when it works here) a command sees the host's system read-only and the
sandbox's private directories mounted at those paths, in its own PID namespace, without
network when the sandbox was created without internet access. Without bubblewrap the
paths are mapped textually: ``cwd`` and every ``/workspace``, ``/home/user`` or ``/tmp``
in the command line point into the sandbox's directory instead — an approximation.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from testing.fakes.e2b.world import HOME, FakeSandbox

PRIVATE = ("workspace", "home", "tmp")
_SANDBOX_PATH = re.compile(r"(?<![\w./-])(/workspace|/home/user|/tmp)(?=[/\s'\"]|$)")


@functools.cache
def bwrap_works() -> bool:
    """Whether bubblewrap can build the sandbox view on this machine."""
    if shutil.which("bwrap") is None:
        return False
    with tempfile.TemporaryDirectory() as root:
        for directory in ("workspace", "home/user", "tmp"):
            Path(root, directory).mkdir(parents=True)
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


def _bwrap(root: Path, cwd: str, *, network: bool) -> list[str]:
    args = ["bwrap", "--tmpfs", "/"]
    for entry in sorted(Path("/").iterdir()):
        if entry.name in (*PRIVATE, "proc", "dev", "sys"):
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), str(entry)]
        elif entry.exists():
            args += ["--ro-bind", str(entry), str(entry)]
    args += ["--dev", "/dev", "--proc", "/proc"]
    args += ["--bind", str(root / "workspace"), "/workspace"]
    args += ["--bind", str(root / "home" / "user"), HOME]
    args += ["--bind", str(root / "tmp"), "/tmp"]
    args += ["--unshare-pid", "--die-with-parent", "--chdir", cwd]
    if not network:
        args.append("--unshare-net")
    return args


def _has_network(created: dict[str, Any] | None) -> bool:
    # Allow-lists are not enforced by the fake (it is no firewall): only "none" is.
    return not (created and created.get("allow_internet_access") is False)


def command_line(
    sandbox: FakeSandbox, config: dict[str, Any], created: dict[str, Any] | None
) -> tuple[list[str], Path | None, dict[str, str]]:
    """argv, host cwd (None when bubblewrap changes directory) and env for a command."""
    cwd = config.get("cwd") or HOME
    args = [a for a in config.get("args", []) if a != "-l"]  # keep the host profile out
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        **sandbox.envs,
        **config.get("envs", {}),
    }
    if bwrap_works():
        env.setdefault("HOME", HOME)
        prefix = _bwrap(sandbox.root, cwd, network=_has_network(created))
        return [*prefix, config["cmd"], *args], None, env
    env.setdefault("HOME", str(sandbox.host_path(HOME)))
    mapped = [_SANDBOX_PATH.sub(lambda m: f"{sandbox.root}{m.group(1)}", arg) for arg in args]
    return [config["cmd"], *mapped], sandbox.host_path(cwd), env
