"""The Starlette app speaking the Vercel Sandbox REST and NDJSON calls the SDK makes.

Wire facts: ``/work/shared/reference/vercel.md`` (vercel-sandbox 0.10.0). Every error
answers ``{"error": {"code", "message"}}``; the message carries a marker
(:data:`BODY_MARKER`) so tests can prove no provider body reaches a relay answer or log.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from testing.fakes.vercel.sandboxes import FakeCommand, FakeSandbox, start_command, write_stdin
from testing.fakes.vercel.world import World

BODY_MARKER = "fake-vercel-body-7f3a"
BAD_KEY = "bad-key"
NDJSON = "application/x-ndjson"


def error(status: int, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = f"{code} ({BODY_MARKER}, token=sk-should-never-leak)"
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


async def _chunks(handle: BinaryIO) -> AsyncIterator[bytes]:
    """A file's bytes as ``fs/read`` streams them (closed at the end, or when the client
    leaves)."""
    with handle:
        while chunk := await asyncio.to_thread(handle.read, 65_536):
            yield chunk


def line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record) + "\n").encode()


def build_app(world: World) -> Starlette:
    """The fake's routes, closed over one :class:`World`."""
    ledger, faults = world.ledger, world.faults

    def authorize(request: Request) -> JSONResponse | None:
        header = request.headers.get("authorization", "")
        token = header.removeprefix("Bearer ").strip()
        with ledger.lock:
            ledger.tokens.add(token)
            if team := request.query_params.get("teamId"):
                ledger.team_ids.add(team)
        if not token or token == BAD_KEY:
            return error(401, "forbidden")
        return None

    def session_box(request: Request) -> FakeSandbox | JSONResponse:
        if (denied := authorize(request)) is not None:
            return denied
        box = world.by_session(request.path_params["sid"])
        if box is None:
            return error(404, "not_found")
        if box.status != "running":
            return error(410, "sandbox_stopped")
        return box

    def command_of(request: Request) -> tuple[FakeSandbox, FakeCommand] | JSONResponse:
        box = world.by_session(request.path_params["sid"])
        if (denied := authorize(request)) is not None:
            return denied
        if box is None or request.path_params["cid"] not in box.commands:
            return error(404, "not_found")
        return box, box.commands[request.path_params["cid"]]

    async def create(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        if faults.create_status is not None:
            status = faults.create_status
            headers = {"retry-after": str(faults.retry_after_s)} if status == 429 else None
            return error(status, "injected", headers)
        body = await request.json()
        if body.get("name") in world.sandboxes:
            return error(409, "sandbox_exists")
        box = world.allocate(body, request.query_params.get("teamId"))
        if faults.create_allocates_then_fails:
            return error(500, "internal_server_error")
        if faults.create_hang:
            await world.hang.wait()
            return error(503, "shutting_down")
        return JSONResponse(
            {"sandbox": box.sandbox_payload(), "session": box.session_payload(), "routes": []}
        )

    async def get_sandbox(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        box = world.sandboxes.get(request.path_params["name"])
        if box is None:
            return error(404, "not_found")
        return JSONResponse(
            {"sandbox": box.sandbox_payload(), "session": box.session_payload(), "routes": []}
        )

    async def list_sandboxes(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        if faults.list_status is not None:
            return error(faults.list_status, "injected")
        project = request.query_params.get("project")
        boxes = [box for box in world.sandboxes.values() if project in (None, box.project_id)]
        if tag := request.query_params.get("tags"):
            key, _, value = tag.partition(":")
            boxes = [box for box in boxes if box.tags.get(key) == value]
        boxes.sort(key=lambda box: box.created_at, reverse=True)
        return JSONResponse(
            {
                "sandboxes": [box.sandbox_payload() for box in boxes],
                "pagination": {"count": len(boxes), "next": None, "prev": None},
            }
        )

    async def destroy(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        name = request.path_params["name"]
        if name not in world.sandboxes:
            return error(404, "not_found")
        if faults.take_terminate_failure():
            return error(500, "internal_server_error")
        box = world.destroy(name)
        assert box is not None
        with ledger.lock:
            ledger.destroys.append(name)
        return JSONResponse({"sandbox": box.sandbox_payload()})

    async def stop(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        box = world.by_session(request.path_params["sid"])
        if box is None:
            return error(404, "not_found")
        if faults.take_terminate_failure():
            return error(500, "internal_server_error")
        world.stop(box.name)
        with ledger.lock:
            ledger.stops.append(box.name)
        return JSONResponse({"session": box.session_payload(), "sandbox": box.sandbox_payload()})

    async def run(request: Request) -> Response:
        found = session_box(request)
        if isinstance(found, JSONResponse):
            return found
        box, body = found, await request.json()
        cwd = body.get("cwd") or "/vercel/sandbox"
        if not box.host_path(cwd).is_dir():
            return error(400, "cwd_not_found")
        entry: dict[str, Any] = {}
        with ledger.lock:
            ledger.commands.append(entry)
            entry.update(
                {
                    "sandbox": box.name,
                    "name": body["command"],
                    "args": list(body.get("args") or []),
                    "cwd": cwd,
                    "env_names": sorted(body.get("env") or {}),
                    "sudo": bool(body.get("sudo")),
                    "timeout_ms": body.get("timeout"),
                }
            )
        command = await start_command(
            box,
            name=body["command"],
            args=list(body.get("args") or []),
            cwd=cwd,
            env=dict(body.get("env") or {}),
            timeout_ms=body.get("timeout"),
            attach_stdin=bool(body.get("attachStdin")),
        )
        with ledger.lock:
            entry["pid"] = None if command.process is None else command.process.pid
        if request.query_params.get("wait") != "true" and not body.get("wait"):
            return JSONResponse({"command": command.payload()})
        stream = follow(command, with_commands=True, cut=faults.cut_stream)
        return StreamingResponse(stream, media_type=NDJSON)

    async def follow(
        command: FakeCommand, *, with_commands: bool, cut: bool = False
    ) -> AsyncIterator[bytes]:
        if with_commands:
            yield line({"command": {**command.payload(), "exitCode": None}})
        sent = 0
        while True:
            changed = command.changed.current()
            while sent < len(command.logs):
                yield line(command.logs[sent])
                sent += 1
                if cut:
                    return  # the connection breaks mid-run: no final record
            if command.lost == "stopped":
                error_data = {"code": "sandbox_stopped", "message": f"stopped ({BODY_MARKER})"}
                yield line({"stream": "error", "data": error_data})
                return
            if command.lost is not None or (cut and command.done):
                return
            if command.done:
                if with_commands:
                    yield line({"command": command.payload()})
                return
            await changed.wait()

    async def logs(request: Request) -> Response:
        found = command_of(request)
        if isinstance(found, JSONResponse):
            return found
        return StreamingResponse(follow(found[1], with_commands=False), media_type=NDJSON)

    async def get_command(request: Request) -> Response:
        found = command_of(request)
        if isinstance(found, JSONResponse):
            return found
        command = found[1]
        if request.query_params.get("wait") == "true":
            while not command.done and command.lost is None:
                await command.changed.current().wait()
        if command.lost is not None:
            return error(410, "sandbox_stopped")
        return JSONResponse({"command": command.payload()})

    async def stdin(request: Request) -> Response:
        found = command_of(request)
        if isinstance(found, JSONResponse):
            return found
        command, body = found[1], await request.json()
        if not command.stdin_attached:
            return error(400, "command_stdin_unavailable")
        data = base64.b64decode(body.get("data", ""))
        if data or body.get("close"):
            try:
                await write_stdin(command, data, int(body.get("offset") or 0), body.get("close"))
            except (BrokenPipeError, ConnectionResetError):
                return error(400, "command_stdin_unavailable")
        return JSONResponse({"command": command.payload(), "bytesWritten": command.stdin_written})

    async def kill(request: Request) -> Response:
        found = command_of(request)
        if isinstance(found, JSONResponse):
            return found
        command, body = found[1], await request.json()
        process = command.process
        if process is not None and process.returncode is None:
            os.killpg(process.pid, int(body.get("signal", 15)))
        return JSONResponse({"command": command.payload()})

    async def write_files(request: Request) -> Response:
        found = session_box(request)
        if isinstance(found, JSONResponse):
            return found
        base = request.headers.get("x-cwd", "/")
        raw = await request.body()
        try:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw)), mode="r:") as archive:
                for member in archive.getmembers():
                    handle = archive.extractfile(member) if member.isfile() else None
                    if handle is None:
                        continue
                    target = found.host_path(member.name, base)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(handle.read())
                    target.chmod(member.mode & 0o777)
        except (OSError, ValueError, tarfile.TarError):
            return error(400, "bad_archive")
        return Response(status_code=200)

    async def mkdir(request: Request) -> Response:
        found = session_box(request)
        if isinstance(found, JSONResponse):
            return found
        body = await request.json()
        try:
            target = found.host_path(body["path"], body.get("cwd") or "/vercel/sandbox")
            target.mkdir(parents=bool(body.get("recursive", True)), exist_ok=True)
        except (OSError, ValueError):
            return error(400, "mkdir_failed")
        return JSONResponse({})

    async def read_file(request: Request) -> Response:
        found = session_box(request)
        if isinstance(found, JSONResponse):
            return found
        body = await request.json()
        try:
            target = found.host_path(body["path"], body.get("cwd") or "/vercel/sandbox")
            handle = target.open("rb")
        except (OSError, ValueError):
            return error(404, "file_not_found")
        return StreamingResponse(_chunks(handle), media_type="application/octet-stream")

    session = "/v2/sandboxes/sessions/{sid}"
    routes = [
        Route("/v3/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", list_sandboxes, methods=["GET"]),
        Route(f"{session}/stop", stop, methods=["POST"]),
        Route(f"{session}/cmd", run, methods=["POST"]),
        Route(f"{session}/cmd/{{cid}}", get_command, methods=["GET"]),
        Route(f"{session}/cmd/{{cid}}/logs", logs, methods=["GET"]),
        Route(f"{session}/cmd/{{cid}}/stdin", stdin, methods=["POST"]),
        Route(f"{session}/cmd/{{cid}}/kill", kill, methods=["POST"]),
        Route(f"{session}/fs/write", write_files, methods=["POST"]),
        Route(f"{session}/fs/mkdir", mkdir, methods=["POST"]),
        Route(f"{session}/fs/read", read_file, methods=["POST"]),
        Route("/v2/sandboxes/{name}", get_sandbox, methods=["GET"]),
        Route("/v2/sandboxes/{name}", destroy, methods=["DELETE"]),
    ]
    return Starlette(routes=routes)
