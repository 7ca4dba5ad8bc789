"""The fake envd: Connect RPC (JSON codec) for commands, plain HTTP for files and health.

One URL serves every sandbox; requests are routed on the ``E2b-Sandbox-Id`` header and
checked against the ``X-Access-Token`` the create returned. A sandbox that is gone
answers 502 "... was not found", as E2B's proxy does.

Commands run as real local processes (``bash -c``, without ``-l`` so the host's profile
stays out), each in its own session so the whole group can be killed, seeing the
sandbox's private ``/workspace``, ``/home/user`` and ``/tmp`` (see ``isolation.py``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from testing.fakes.e2b.isolation import command_line
from testing.fakes.e2b.world import HOME, FakeProcess, FakeSandbox, World, kill_group

CONNECT_STREAM = "application/connect+json"


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(error: dict[str, str] | None = None) -> bytes:
    return frame({"error": error} if error else {}, flags=0x02)


def unframe(body: bytes) -> dict[str, Any]:
    _flags, length = struct.unpack(">BI", body[:5])
    parsed: dict[str, Any] = json.loads(body[5 : 5 + length])
    return parsed


def not_found(sandbox_id: str) -> JSONResponse:
    return JSONResponse({"code": 502, "message": f"The sandbox {sandbox_id} was not found"}, 502)


class Envd:
    """The envd handlers, bound to one :class:`World`."""

    def __init__(self, world: World) -> None:
        self.world = world

    def _sandbox(self, request: Request) -> tuple[FakeSandbox | None, Response | None]:
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        sandbox = self.world.get(sandbox_id)
        if sandbox is None:
            return None, not_found(sandbox_id)
        if request.headers.get("x-access-token") != sandbox.access_token:
            return None, JSONResponse({"code": 401, "message": "bad access token"}, 401)
        return sandbox, None

    async def health(self, request: Request) -> Response:
        _sandbox, denied = self._sandbox(request)
        return denied or Response(status_code=204)

    async def write_files(self, request: Request) -> Response:
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        written: list[dict[str, str]] = []
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            async with request.form() as form:
                for _name, part in form.multi_items():
                    if isinstance(part, str):
                        continue
                    path = request.query_params.get("path") or part.filename or ""
                    written.append(self._write(sandbox, path, await part.read()))
        else:
            path = request.query_params["path"]
            written.append(self._write(sandbox, path, await request.body()))
        return JSONResponse(written)

    @staticmethod
    def _write(sandbox: FakeSandbox, path: str, data: bytes) -> dict[str, str]:
        target = sandbox.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return {"name": target.name, "path": path, "type": "file"}

    async def read_file(self, request: Request) -> Response:
        """``GET /files?path=…``: the file's bytes, streamed (envd follows links, within
        the sandbox); 404 ``{"code", "message"}`` when there is no such file."""
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        path = request.query_params.get("path", "")
        target = _inside(sandbox, sandbox.host_path(path))
        if target is None or not target.is_file():
            return JSONResponse({"code": 404, "message": f"path '{path}' does not exist"}, 404)
        return StreamingResponse(_chunks(target), media_type="application/octet-stream")

    async def list_dir(self, request: Request) -> Response:
        """``filesystem.Filesystem/ListDir`` (unary, JSON codec): ``{"entries": [EntryInfo]}``
        one level deep. As newer envd does, a link is ``isSymlink`` with its target's type
        (``FILE_TYPE_UNSPECIFIED`` when dangling or special); a FIFO, socket or device is
        ``FILE_TYPE_UNSPECIFIED`` (which the SDK leaves out)."""
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        path = str((await request.json()).get("path", ""))
        folder = _inside(sandbox, sandbox.host_path(path))
        if folder is None or not folder.exists():
            return JSONResponse({"code": "not_found", "message": f"{path} not found"}, 404)
        if not folder.is_dir():
            message = f"path {path} is not a directory"
            return JSONResponse({"code": "invalid_argument", "message": message}, 400)
        return JSONResponse({"entries": [_entry(path, child) for child in folder.iterdir()]})

    async def make_dir(self, request: Request) -> Response:
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        path = (await request.json())["path"]
        target = sandbox.host_path(path)
        if target.exists():
            return JSONResponse({"code": "already_exists", "message": "exists"}, 409)
        target.mkdir(parents=True)
        return JSONResponse({"entry": {"name": target.name, "path": path, "type": 2}})

    async def send_signal(self, request: Request) -> Response:
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        body = await request.json()
        pid = int(body["process"]["pid"])
        if not self.world.signal(sandbox, pid, str(body.get("signal", ""))):
            return JSONResponse({"code": "not_found", "message": "no such process"}, 404)
        return JSONResponse({})

    async def start(self, request: Request) -> Response:
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        config = unframe(await request.body())["process"]
        timeout_ms = request.headers.get("connect-timeout-ms")
        with self.world.ledger.lock:
            self.world.ledger.commands.append(
                {"sandbox_id": sandbox.sandbox_id, **config, "timeout_ms": timeout_ms}
            )
        if not sandbox.host_path(config.get("cwd") or HOME).is_dir():
            error = {"code": "invalid_argument", "message": "cwd does not exist"}
            return StreamingResponse(iter([end_of_stream(error)]), media_type=CONNECT_STREAM)
        created = self.world.ledger.create_of(sandbox.sandbox_id)
        argv, cwd, env = command_line(sandbox, config, created)
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        running = FakeProcess(process)
        sandbox.processes[process.pid] = running
        queue = running.subscribe()
        # The pump outlives any one stream: a client that goes away leaves the process
        # running, as envd does (only SendSignal or the sandbox's death stops it).
        sandbox.pumps.add(asyncio.get_running_loop().create_task(_pump(sandbox, running)))
        faults = self.world.faults
        events = _events(
            running, queue, _seconds(timeout_ms), cut=faults.cut_stream, drop=faults.drop_connection
        )
        return StreamingResponse(events, media_type=CONNECT_STREAM)

    async def connect(self, request: Request) -> Response:
        """Follow a running process again (after a broken stream); no replay of output."""
        sandbox, denied = self._sandbox(request)
        if sandbox is None:
            return denied or not_found("")
        pid = int(unframe(await request.body())["process"]["pid"])
        running = sandbox.processes.get(pid)
        if running is None:
            error = {"code": "not_found", "message": f"process with pid {pid} not found"}
            return StreamingResponse(iter([end_of_stream(error)]), media_type=CONNECT_STREAM)
        with self.world.ledger.lock:
            self.world.ledger.reconnects.append((sandbox.sandbox_id, pid))
        timeout_s = _seconds(request.headers.get("connect-timeout-ms"))
        queue = running.subscribe()
        return StreamingResponse(
            _events(running, queue, timeout_s, cut=False), media_type=CONNECT_STREAM
        )

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/files", self.write_files, methods=["POST"]),
            Route("/files", self.read_file, methods=["GET"]),
            Route("/filesystem.Filesystem/ListDir", self.list_dir, methods=["POST"]),
            Route("/process.Process/Start", self.start, methods=["POST"]),
            Route("/process.Process/Connect", self.connect, methods=["POST"]),
            Route("/process.Process/SendSignal", self.send_signal, methods=["POST"]),
            Route("/filesystem.Filesystem/MakeDir", self.make_dir, methods=["POST"]),
        ]


def _inside(sandbox: FakeSandbox, target: Path) -> Path | None:
    """``target`` with its links resolved, if that stays in the sandbox (a link out of it
    names a path of the sandbox's own system, which the fake does not have)."""
    resolved = target.resolve()
    return resolved if resolved.is_relative_to(sandbox.root.resolve()) else None


def _file_type(target: Path) -> str:
    if target.is_dir():
        return "FILE_TYPE_DIRECTORY"
    if target.is_file():
        return "FILE_TYPE_FILE"
    return "FILE_TYPE_UNSPECIFIED"


def _entry(folder: str, child: Path) -> dict[str, Any]:
    """One ``EntryInfo`` in the proto3 JSON mapping (int64 as a string)."""
    status = child.lstat()
    link = child.is_symlink()
    entry: dict[str, Any] = {
        "name": child.name,
        "type": _file_type(child),
        "path": f"{folder.rstrip('/')}/{child.name}",
        "size": str(status.st_size),
        "mode": status.st_mode & 0o777,
        "permissions": stat.filemode(status.st_mode),
        "owner": "root",
        "group": "root",
        "isSymlink": link,
    }
    if link:
        entry["symlinkTarget"] = os.readlink(child)
    return entry


async def _chunks(target: Path) -> AsyncIterator[bytes]:
    with target.open("rb") as file:
        while chunk := file.read(65_536):
            yield chunk


def _seconds(timeout_ms: str | None) -> float | None:
    return float(timeout_ms) / 1000 if timeout_ms else None


async def _events(
    running: FakeProcess,
    queue: asyncio.Queue[tuple[str, Any]],
    timeout_s: float | None,
    *,
    cut: bool,
    drop: bool = False,
) -> AsyncIterator[bytes]:
    """One Start/Connect stream: start, data..., end, end-of-stream (or a fault)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    process = running.process
    try:
        yield frame({"event": {"start": {"pid": process.pid}}})
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                kind, value = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                # envd enforces connect-timeout-ms itself: kill and end the stream.
                kill_group(process)
                yield end_of_stream({"code": "deadline_exceeded", "message": "deadline exceeded"})
                return
            if kind == "data":
                stream, chunk = value
                data = base64.b64encode(chunk).decode()
                yield frame({"event": {"data": {stream: data}}})
            elif kind == "exit":
                if not cut:
                    code = value if value >= 0 else -1
                    status = f"exit status {code}" if value >= 0 else "signal: killed"
                    end = {"exitCode": code, "exited": value >= 0, "status": status}
                    yield frame({"event": {"end": end}})
                yield end_of_stream()
                return
            elif kind == "gone":
                message = "the connection to the sandbox ended before the stream completed"
                yield end_of_stream({"code": "unavailable", "message": message})
                return
            if cut:
                # Fault: the stream ends mid-run without an end event; the process
                # keeps running, as it would in a real sandbox.
                yield end_of_stream()
                return
            if drop:
                # Fault: the connection dies mid-body (the server aborts the response).
                raise ConnectionAbortedError("injected dropped connection")
    finally:
        running.unsubscribe(queue)


async def _pump(sandbox: FakeSandbox, running: FakeProcess) -> None:
    """Publish a process's output and exit status to whoever follows it."""
    process = running.process

    async def read(stream: asyncio.StreamReader | None, name: str) -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            running.publish(("data", (name, chunk)))

    await asyncio.gather(read(process.stdout, "stdout"), read(process.stderr, "stderr"))
    code = await process.wait()
    # Gone from the process table once it has ended: a later Connect is "not found".
    sandbox.processes.pop(process.pid, None)
    running.publish(("exit", code))
