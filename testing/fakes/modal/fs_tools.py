"""The fake's ``modal-sandbox-fs-tools`` reads, as modal 1.6.4's client calls and parses them.

The client runs ``/__modal/.bin/modal-sandbox-fs-tools '<json>'`` as an exec
(``modal/sandbox/_filesystem.py``, commands built by ``modal/_utils/sandbox_fs_utils.py``):

- ``{"ListFiles": {"path": …}}``: stdout is a JSON array of entries with ``name``,
  ``path``, ``type`` (``file``, ``directory`` or ``symlink``: the entry itself, a link not
  followed), ``size``, ``mode`` (the whole ``st_mode``), ``permissions``, ``owner``,
  ``group``, ``modified_time`` and ``symlink_target``;
- ``{"ReadFile": {"path": …}}``: stdout is the file's bytes;
- a failure exits 1 with ``{"error_kind", "message", "detail"}`` on stderr, whose
  ``error_kind`` (``NotFound``, ``NotDirectory``, ``IsDirectory``…) picks the exception.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from testing.fakes.modal.state import Output, SandboxState

CHUNK = 64 * 1024


def _failure(kind: str, message: str) -> dict[str, str]:
    return {"error_kind": kind, "message": message, "detail": ""}


def _entry(path: str, child: Path) -> dict[str, Any]:
    status = child.lstat()
    kind = (
        "symlink" if stat.S_ISLNK(status.st_mode)
        else "directory" if stat.S_ISDIR(status.st_mode)
        else "file"
    )  # fmt: skip
    return {
        "name": child.name,
        "path": f"{path.rstrip('/')}/{child.name}",
        "type": kind,
        "size": status.st_size,
        "mode": status.st_mode,
        "permissions": stat.filemode(status.st_mode)[1:],
        "owner": "root",
        "group": "root",
        "modified_time": status.st_mtime,
        "symlink_target": str(child.readlink()) if kind == "symlink" else None,
    }


async def answer(
    sandbox: SandboxState, command: dict[str, Any], stdout: Output
) -> dict[str, str] | None:
    """Serve a ``ListFiles`` or ``ReadFile`` into ``stdout``; the stderr payload of a
    failure, or ``None``."""
    if "ListFiles" in command:
        path = str(command["ListFiles"]["path"])
        folder = sandbox.host_path(path)
        if not folder.exists():
            return _failure("NotFound", "No such file or directory")
        if not folder.is_dir():
            return _failure("NotDirectory", "Not a directory")
        listing = [_entry(path, child) for child in sorted(folder.iterdir())]
        await stdout.append(json.dumps(listing).encode())
        return None
    path = str(command["ReadFile"]["path"])
    target = sandbox.host_path(path)
    if not target.exists():
        return _failure("NotFound", "No such file or directory")
    if target.is_dir():
        return _failure("IsDirectory", "Is a directory")
    with target.open("rb") as file:
        while chunk := file.read(CHUNK):
            await stdout.append(chunk)
    return None
