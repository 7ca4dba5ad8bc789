"""The fake toolbox's file reads, as daytona 0.226.1's SDK calls them.

- ``GET <tb>/<id>/files?path=&depth=``: ``fs.list_files`` (the toolbox client's
  ``list_files``): a JSON array of ``FileInfo`` (``name``, ``isDir``, ``size``, ``mode`` as
  Go's ``FileMode.String()``: ``-rw-r--r--``, ``drwxr-xr-x``, ``Lrwxrwxrwx`` for a link,
  ``prw-r--r--`` for a FIFO; the daemon lists with ``lstat``, so a link is never followed),
  ``modTime``, ``permissions``, ``owner``, ``group``, ``path``. A missing folder is
  ``404 {"code": "FILE_NOT_FOUND", "source": "DAYTONA_DAEMON"}``
  (``DaytonaFileNotFoundError`` in the SDK).
- ``POST <tb>/<id>/files/bulk-download`` with ``{"paths": [...]}``: what
  ``fs.download_file_stream`` (and ``download_files``) send; the answer is
  ``multipart/form-data``, one part per path: ``name="file"; filename="<path>"`` with its
  bytes, or ``name="error"; filename="<path>"`` with a JSON error
  (``{"message", "statusCode", "code"}``). Streamed, a chunk at a time.
"""

from __future__ import annotations

import json
import secrets
import stat
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from testing.fakes.daytona.world import FakeSandbox

BoxOf = Callable[[Request], tuple[FakeSandbox | None, Response | None]]
CHUNK = 65_536


def daemon_error(status: int, message: str, code: str) -> dict[str, Any]:
    return {"statusCode": status, "message": message, "code": code, "source": "DAYTONA_DAEMON"}


def _mode(status: Any) -> str:
    """Go's ``FileMode.String()`` of an lstat result."""
    mode = status.st_mode
    kind = (
        "d" if stat.S_ISDIR(mode)
        else "L" if stat.S_ISLNK(mode)
        else "p" if stat.S_ISFIFO(mode)
        else "S" if stat.S_ISSOCK(mode)
        else "Dc" if stat.S_ISCHR(mode)
        else "D" if stat.S_ISBLK(mode)
        else "-"
    )  # fmt: skip
    return kind + stat.filemode(mode)[1:]


def _info(folder: str, child: Path) -> dict[str, Any]:
    status = child.lstat()
    changed = datetime.fromtimestamp(status.st_mtime, UTC)
    return {
        "name": child.name,
        "isDir": stat.S_ISDIR(status.st_mode),
        "size": status.st_size,
        "mode": _mode(status),
        "modTime": changed.strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC"),
        "modifiedAt": changed.isoformat().replace("+00:00", "Z"),
        "permissions": oct(status.st_mode & 0o777),
        "owner": "daytona",
        "group": "daytona",
        "path": f"{folder.rstrip('/')}/{child.name}",
    }


def handlers(box_of: BoxOf) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(list_files, bulk_download)``, answering for the sandbox ``box_of`` finds."""

    async def list_files(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or JSONResponse({}, 404)
        path = request.query_params.get("path", "")
        try:
            folder = sandbox.host_path(path)
        except ValueError:
            folder = None
        if folder is None or not folder.is_dir():
            body = daemon_error(404, f"directory not found: {path}", "FILE_NOT_FOUND")
            return JSONResponse(body, 404)
        return JSONResponse([_info(path, child) for child in sorted(folder.iterdir())])

    async def bulk_download(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or JSONResponse({}, 404)
        paths = [str(path) for path in (await request.json()).get("paths", [])]
        boundary = secrets.token_hex(16)
        return StreamingResponse(
            _parts(sandbox, paths, boundary),
            media_type=f"multipart/form-data; boundary={boundary}",
        )

    return list_files, bulk_download


async def _parts(sandbox: FakeSandbox, paths: list[str], boundary: str) -> AsyncIterator[bytes]:
    for path in paths:
        try:
            target: Path | None = sandbox.host_path(path)
        except ValueError:
            target = None
        name = json.dumps(path)
        if target is None or not target.is_file():
            error = daemon_error(404, f"file not found: {path}", "FILE_NOT_FOUND")
            yield (
                (
                    f'--{boundary}\r\nContent-Disposition: form-data; name="error"; '
                    f"filename={name}\r\nContent-Type: application/json\r\n\r\n"
                ).encode()
                + json.dumps(error).encode()
                + b"\r\n"
            )
            continue
        size = target.stat().st_size
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f"filename={name}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {size}\r\n\r\n"
        ).encode()
        with target.open("rb") as file:
            while chunk := file.read(CHUNK):
                yield chunk
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode()
