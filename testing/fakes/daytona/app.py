"""The fake's HTTP surface: the control API under ``/api`` and the toolbox under ``/toolbox``.

Shapes follow daytona 0.226.1's generated clients (shared/reference/daytona.md): camelCase
JSON, create answers ``200`` with a full Sandbox DTO already ``started`` (so the SDK does
not poll), delete answers ``200`` with a DTO ``destroying`` (still listed for a moment; a
second delete meanwhile is ``409``), errors are
``{"statusCode", "message", "code", "source"}``. The toolbox lives at
``<url>/toolbox/<sandboxId>/...``: sessions, session commands, their log WebSocket (stdout
and stderr framed by ``\\x01\\x01\\x01`` / ``\\x02\\x02\\x02``), bulk upload, and the file
reads of ``files.py`` (listing, bulk download).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from testing.fakes.daytona import files
from testing.fakes.daytona.world import FakeCommand, FakeSandbox, World

BAD_KEY = "bad-key"
BODY_MARKER = "daytona-fake-body"
"""In every error body the fake sends: it must never reach a relay answer or log."""
STDOUT_MARK = b"\x01\x01\x01"
STDERR_MARK = b"\x02\x02\x02"


def error(status: int, message: str, code: str = "", **headers: str) -> JSONResponse:
    body = {
        "statusCode": status,
        "message": f"{message} ({BODY_MARKER})",
        "code": code or str(status),
        "source": "DAYTONA_API",
    }
    return JSONResponse(body, status, headers=headers)


def _authorized(headers: Any) -> bool:
    value = headers.get("authorization", "")
    return value.startswith("Bearer ") and value.removeprefix("Bearer ") not in ("", BAD_KEY)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def dto(sandbox: FakeSandbox, toolbox_url: str) -> dict[str, Any]:
    body = sandbox.body
    ttl = int(body.get("ttlMinutes") or 0)
    answer: dict[str, Any] = {
        "id": sandbox.sandbox_id,
        "organizationId": "org-fake",
        "name": sandbox.name,
        "user": "daytona",
        "env": dict(body.get("env") or {}),
        "labels": sandbox.labels,
        "public": bool(body.get("public")),
        "networkBlockAll": bool(body.get("networkBlockAll")),
        "kvm": False,
        "target": str(body.get("target") or "us"),
        "cpu": int(body.get("cpu") or 1),
        "gpu": 0,
        "memory": int(body.get("memory") or 1),
        "disk": int(body.get("disk") or 3),
        "state": sandbox.state,
        "toolboxProxyUrl": toolbox_url,
        "createdAt": _iso(sandbox.created_at),
        "autoStopInterval": int(body.get("autoStopInterval", 15)),
        "autoDeleteInterval": int(body.get("autoDeleteInterval", -1)),
    }
    if ttl:
        answer["autoDestroyAt"] = _iso(sandbox.created_at + ttl * 60)
    return answer


def build_app(world: World, base_url: str) -> Starlette:
    """The fake, bound to one world; ``base_url`` is where it is served."""
    toolbox_url = f"{base_url}/toolbox"

    def denied(request: Request) -> Response | None:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        with world.ledger.lock:
            world.ledger.keys.add(key)
        if _authorized(request.headers):
            return None
        return error(401, "invalid API key", "UNAUTHORIZED")

    # -- control API ------------------------------------------------------------------------

    async def create(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        with world.ledger.lock:
            world.ledger.create_attempts += 1
        faults = world.faults
        if faults.create_hang:
            await world.hang.wait()
            return error(503, "released")
        if faults.create_status is not None:
            headers = {"Retry-After": faults.retry_after_s} if faults.create_status == 429 else {}
            return error(faults.create_status, "injected failure", **headers)
        body = await request.json()
        sandbox = world.create(body)
        if faults.create_allocates_then_fails:
            return error(500, "injected failure after allocation")
        return JSONResponse(dto(sandbox, toolbox_url))

    async def list_sandboxes(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        wanted: dict[str, str] = json.loads(request.query_params.get("labels") or "{}")
        found = [s for s in world.listed() if all(s.labels.get(k) == v for k, v in wanted.items())]
        limit = min(int(request.query_params.get("limit") or 100), world.page_size)
        start = int(request.query_params.get("cursor") or 0)
        page, rest = found[start : start + limit], found[start + limit :]
        items = []
        for sandbox in page:
            item = dto(sandbox, toolbox_url)
            del item["env"], item["kvm"]
            items.append(item)
        return JSONResponse({"items": items, "nextCursor": str(start + limit) if rest else None})

    async def get_sandbox(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        sandbox = world.get(request.path_params["sandbox"])
        if sandbox is None:
            return error(404, "sandbox not found", "NOT_FOUND")
        return JSONResponse(dto(sandbox, toolbox_url))

    async def delete_sandbox(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        if world.faults.terminate_failures > 0:
            world.faults.terminate_failures -= 1
            return error(500, "injected delete failure")
        found = world.get(request.path_params["sandbox"])
        if found is not None and found.state == "destroying":
            # A state change already under way: Daytona refuses another one meanwhile.
            return error(409, "sandbox state change in progress", "CONFLICT")
        sandbox = world.delete(request.path_params["sandbox"])
        if sandbox is None:
            return error(404, "sandbox not found", "NOT_FOUND")
        return JSONResponse(dto(sandbox, toolbox_url))

    async def proxy_url(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        return JSONResponse({"url": toolbox_url})

    async def no_socketio(request: Request) -> Response:
        return error(404, "no event stream here")

    # -- toolbox ----------------------------------------------------------------------------

    def box_of(request: Request) -> tuple[FakeSandbox | None, Response | None]:
        if (refused := denied(request)) is not None:
            return None, refused
        sandbox = world.get(request.path_params["sandbox"])
        if sandbox is None or sandbox.state != "started":
            return None, error(404, "sandbox not found", "NOT_FOUND")
        return sandbox, None

    async def create_session(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or error(404, "sandbox not found")
        session = (await request.json())["sessionId"]
        if session in sandbox.sessions:
            return error(409, "session exists", "CONFLICT")
        sandbox.sessions[session] = {}
        return Response(status_code=201)

    async def delete_session(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or error(404, "sandbox not found")
        if not world.end_session(sandbox, request.path_params["session"]):
            return error(404, "session not found", "SESSION_NOT_FOUND")
        return Response(status_code=204)

    async def execute(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or error(404, "sandbox not found")
        session = request.path_params["session"]
        if session not in sandbox.sessions:
            return error(404, "session not found", "SESSION_NOT_FOUND")
        body = await request.json()
        command = await world.execute(sandbox, session, str(body["command"]))
        if not body.get("runAsync"):
            await asyncio.wait_for(command.process.wait(), 60)
            return JSONResponse({"cmdId": command.command_id, "exitCode": command.exit_code})
        return JSONResponse({"cmdId": command.command_id}, 202)

    def command_of(request: Request, sandbox: FakeSandbox) -> FakeCommand | None:
        commands = sandbox.sessions.get(request.path_params["session"], {})
        return commands.get(request.path_params["command"])

    async def get_command(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or error(404, "sandbox not found")
        command = command_of(request, sandbox)
        if command is None:
            return error(404, "command not found", "PROCESS_NOT_FOUND")
        answer: dict[str, Any] = {"id": command.command_id, "command": command.line}
        if command.exit_code is not None:
            answer["exitCode"] = command.exit_code
        return JSONResponse(answer)

    async def logs(websocket: WebSocket) -> None:
        sandbox = world.get(websocket.path_params["sandbox"])
        if not _authorized(websocket.headers) or sandbox is None:
            await websocket.close(1008)
            return
        commands = sandbox.sessions.get(websocket.path_params["session"], {})
        command = commands.get(websocket.path_params["command"])
        if command is None:
            await websocket.close(1008)
            return
        await websocket.accept()
        command.followed += 1
        cut = world.faults.cut_stream and command.followed == 1
        sent = 0
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            while True:
                while sent < len(command.chunks):
                    stream, data = command.chunks[sent]
                    sent += 1
                    mark = STDOUT_MARK if stream == "stdout" else STDERR_MARK
                    await websocket.send_bytes(mark + data)
                    if cut:
                        await websocket.close(1000)
                        return
                if command.exit_code is not None and sent == len(command.chunks):
                    await websocket.close(1000)
                    return
                if sandbox.gone.is_set():
                    await websocket.close(1011, "sandbox is gone")
                    return
                command.changed.clear()
                waits = [asyncio.ensure_future(command.changed.wait())]
                waits.append(asyncio.ensure_future(sandbox.gone.wait()))
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()

    async def bulk_upload(request: Request) -> Response:
        sandbox, refused = box_of(request)
        if sandbox is None:
            return refused or error(404, "sandbox not found")
        paths: dict[str, str] = {}
        contents: dict[str, bytes] = {}
        async with request.form(max_part_size=64 * 1024 * 1024) as form:
            for key, part in form.multi_items():
                index = key.split(".")[0]
                if key.endswith(".path") and isinstance(part, str):
                    paths[index] = part
                elif key.endswith(".file") and not isinstance(part, str):
                    contents[index] = await part.read()
        for index, path in paths.items():
            try:
                target = sandbox.host_path(path)
            except ValueError:
                return error(400, "path leaves the sandbox", "INVALID_FILE_PATH")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(contents.get(index, b""))
        return Response(status_code=200)

    async def index(request: Request) -> Response:
        # Something plain to fetch, for jobs that check the network.
        return Response("fake daytona\n", media_type="text/plain")

    list_files, bulk_download = files.handlers(box_of)
    box = "/toolbox/{sandbox}"
    command_path = box + "/process/session/{session}/command/{command}"
    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/api/socket.io/", no_socketio),
            Route("/api/sandbox", create, methods=["POST"]),
            Route("/api/sandbox", list_sandboxes, methods=["GET"]),
            Route("/api/sandbox/{sandbox}", get_sandbox, methods=["GET"]),
            Route("/api/sandbox/{sandbox}", delete_sandbox, methods=["DELETE"]),
            Route("/api/sandbox/{sandbox}/toolbox-proxy-url", proxy_url, methods=["GET"]),
            Route(box + "/process/session", create_session, methods=["POST"]),
            Route(box + "/process/session/{session}", delete_session, methods=["DELETE"]),
            Route(box + "/process/session/{session}/exec", execute, methods=["POST"]),
            Route(command_path, get_command, methods=["GET"]),
            WebSocketRoute(command_path + "/logs", logs),
            Route(box + "/files/bulk-upload", bulk_upload, methods=["POST"]),
            Route(box + "/files", list_files, methods=["GET"]),
            Route(box + "/files/bulk-download", bulk_download, methods=["POST"]),
        ]
    )
