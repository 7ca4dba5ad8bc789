"""The fake Worker's file reads (``deploy/cloudflare/openapi.yaml`` 1.2.0), as the Worker
answers them from the Sandbox SDK's ``listFiles`` and ``readFileStream``:

- ``GET /v1/jobs/{id}/files?path=``: ``{"files": [{name, type, size}]}`` one level deep,
  ``type`` ``file``, ``directory``, ``symlink`` (never followed) or ``other``;
- ``GET /v1/jobs/{id}/file?path=&limit=``: the file's bytes, at most ``limit``, streamed;
- only a two-step job that has its command (running, ``exited`` or ``timed_out``) and is not
  destroyed nor being destroyed answers: any other is ``409 files_unavailable``; no job ``404 not_found``; no such path
  ``404 no_such_path``; a path that is not relative to /workspace ``400 invalid_request``.
"""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from testing.fakes.cloudflare.contract import Refused
from testing.fakes.cloudflare.job import FakeJob
from testing.fakes.vercel.jail import host_path

WORKSPACE = "/workspace"
MAX_PATH_BYTES = 1024
MAX_LIMIT = 2**31
CHUNK = 65_536


def _error(status: int, code: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": f"{code} (fake Worker)"}}, status)


def _relative(value: str | None, *, folder: bool) -> str:
    """The ``path`` query as the Worker's ``relativePath`` checks it."""
    path = value or ""
    if folder and path == "":
        return ""
    parts = path.split("/")
    if (
        path == ""
        or "\x00" in path
        or len(path.encode()) > MAX_PATH_BYTES
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise Refused(400, "invalid_request", "path: must be a relative path inside /workspace")
    return path


def _kept(job: FakeJob | None) -> Response | None:
    if job is None:
        return _error(404, "not_found")
    up = job.state in ("running", "exited", "timed_out")
    if not job.keep or not up or job.destroyed_at is not None or job.destroy_wanted is not None:
        return _error(409, "files_unavailable")
    return None


def _target(job: FakeJob, path: str) -> Path | None:
    try:
        return host_path(job.root, f"{WORKSPACE}/{path}" if path else WORKSPACE)
    except ValueError:
        return None


def _entry(child: Path) -> dict[str, Any]:
    mode = child.lstat().st_mode
    kind = (
        "symlink" if stat.S_ISLNK(mode)
        else "directory" if stat.S_ISDIR(mode)
        else "file" if stat.S_ISREG(mode)
        else "other"
    )  # fmt: skip
    return {"name": child.name, "type": kind, "size": child.lstat().st_size}


def list_files(request: Request, job: FakeJob | None) -> Response:
    path = _relative(request.query_params.get("path"), folder=True)
    if (refused := _kept(job)) is not None:
        return refused
    assert job is not None
    folder = _target(job, path)
    if folder is None or folder.is_symlink() or not folder.is_dir():
        return _error(404, "no_such_path")
    return JSONResponse({"files": [_entry(child) for child in sorted(folder.iterdir())]})


def read_file(request: Request, job: FakeJob | None) -> Response:
    path = _relative(request.query_params.get("path"), folder=False)
    limit_text = request.query_params.get("limit")
    limit = MAX_LIMIT if limit_text is None else int(limit_text) if limit_text.isdigit() else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise Refused(400, "invalid_query", f"limit takes 1 to {MAX_LIMIT}")
    if (refused := _kept(job)) is not None:
        return refused
    assert job is not None
    target = _target(job, path)
    if target is None or not target.is_file():
        return _error(404, "no_such_path")
    return StreamingResponse(
        _chunks(target, limit),
        media_type="application/octet-stream",
        headers={"cache-control": "no-store"},
    )


async def _chunks(target: Path, limit: int) -> AsyncIterator[bytes]:
    with target.open("rb") as file:
        while limit > 0 and (chunk := file.read(min(CHUNK, limit))):
            limit -= len(chunk)
            yield chunk
