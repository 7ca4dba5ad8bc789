"""The Starlette app speaking the Sprites REST and exec-WebSocket calls the SDK makes.

Wire facts: ``/work/shared/reference/sprites.md`` (sprites-py 0.7.2, with its 2026-12-01
correction from the public API page). Every error answers ``{"error": code, "message":
text}`` (the shape every SDK parser accepts); the message carries :data:`BODY_MARKER` so
tests can prove no provider body reaches a relay answer or log. A refused WebSocket is a
plain HTTP answer before the upgrade, as the SDK expects. The list answers the documented
item ``{name, org_slug, updated_at}`` only, in pages of 1 to 50 items (:data:`MAX_PAGE`;
any other ``max_results`` is a 400), filtered by name prefix only; labels and
``created_at`` come from a get.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from testing.fakes.sprites.world import EXIT, STDOUT, FakeSprite, Session, World

BODY_MARKER = "fake-sprites-body-5c1e"
BAD_KEY = "bad-key"
STDIN, STDIN_EOF = 0, 4
MAX_PAGE = 50
"""The largest ``max_results`` the API takes (the docs: 1 to 50); also its default here."""


def error(status: int, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = f"{code} ({BODY_MARKER}, token=sk-should-never-leak)"
    return JSONResponse({"error": code, "message": message}, status, headers=headers)


def build_app(world: World) -> Starlette:
    """The fake's routes, closed over one :class:`World`."""
    ledger, faults = world.ledger, world.faults

    def authorize(connection: HTTPConnection) -> JSONResponse | None:
        token = connection.headers.get("authorization", "").removeprefix("Bearer ").strip()
        with ledger.lock:
            ledger.tokens.add(token)
        if not token or token == BAD_KEY:
            return error(401, "unauthorized")
        return None

    def sprite_of(connection: HTTPConnection) -> FakeSprite | JSONResponse:
        if (denied := authorize(connection)) is not None:
            return denied
        sprite = world.sprites.get(connection.path_params["name"])
        return error(404, "not_found") if sprite is None else sprite

    def info_of(sprite: FakeSprite) -> dict[str, Any]:
        info = sprite.info()
        if faults.created_at_missing:
            del info["created_at"], info["updated_at"]
        return info

    async def create(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        if faults.create_status is not None:
            status = faults.create_status
            return error(status, "injected", {"retry-after": "7"} if status == 429 else None)
        body: dict[str, Any] = await request.json()
        if not isinstance(body.get("name"), str) or not body["name"]:
            return error(400, "invalid_name")
        if body["name"] in world.sprites:
            return error(409, "already_exists")
        sprite = world.allocate(body)
        if faults.create_allocates_then_fails:
            return error(500, "internal_error")
        if faults.create_hang:
            await world.hang.wait()
            return error(503, "shutting_down")
        if faults.create_delay_s is not None:
            await asyncio.sleep(faults.create_delay_s)  # the sprite exists all along
        return JSONResponse(info_of(sprite), 201)

    async def list_sprites(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        if faults.list_status is not None:
            return error(faults.list_status, "injected")
        prefix = request.query_params.get("prefix") or ""
        asked = request.query_params.get("max_results") or str(MAX_PAGE)
        size = int(asked) if asked.isdigit() else 0
        with ledger.lock:
            ledger.list_sizes.append(size)
        if not 1 <= size <= MAX_PAGE:
            return error(400, "invalid_max_results")
        token = request.query_params.get("continuation_token") or "0"
        start = int(token) if token.isdigit() else 0
        names = sorted(name for name in world.sprites if name.startswith(prefix))
        page = names[start : start + size]
        more = start + size < len(names)
        return JSONResponse(
            {
                "sprites": [world.sprites[name].listed() for name in page],
                "has_more": more,
                "next_continuation_token": str(start + size) if more else None,
            }
        )

    async def get_sprite(request: Request) -> Response:
        sprite = sprite_of(request)
        return sprite if isinstance(sprite, Response) else JSONResponse(info_of(sprite))

    async def delete_sprite(request: Request) -> Response:
        if (denied := authorize(request)) is not None:
            return denied
        if faults.take_terminate_failure():
            return error(500, "internal_error")
        if not world.delete(request.path_params["name"]):
            return error(404, "not_found")
        return Response(status_code=204)

    async def network_policy(request: Request) -> Response:
        sprite = sprite_of(request)
        if isinstance(sprite, Response):
            return sprite
        if faults.policy_status is not None:
            return error(faults.policy_status, "injected")
        if request.method == "GET":
            return JSONResponse({"rules": sprite.policy})
        body = await request.json()
        rules = body.get("rules")
        if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
            return error(400, "invalid_policy")
        await world.set_policy(sprite, rules)
        return Response(status_code=204)

    async def fs_write(request: Request) -> Response:
        sprite = sprite_of(request)
        if isinstance(sprite, Response):
            return sprite
        path = request.query_params.get("path", "")
        try:
            target = sprite.host_path(path, request.query_params.get("workingDir") or "/")
        except ValueError:
            return JSONResponse({"error": "permission denied", "code": "EACCES"}, 403)
        data = await request.body()
        if request.query_params.get("mkdirParents") == "true":
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, int(request.query_params.get("mode") or "0644", 8))
        return JSONResponse({"path": path, "size": len(data), "mode": "0644"})

    async def fs_read(request: Request) -> Response:
        """``GET …/fs/read?path=&workingDir=``: the file's raw bytes; 404 (which the SDK
        raises as ``FileNotFoundError_``) when there is none, ``EISDIR`` for a folder."""
        sprite = sprite_of(request)
        if isinstance(sprite, Response):
            return sprite
        path = request.query_params.get("path", "")
        try:
            target = sprite.host_path(path, request.query_params.get("workingDir") or "/")
        except ValueError:
            return JSONResponse({"error": "permission denied", "code": "EACCES"}, 403)
        if target.is_dir():
            return JSONResponse({"error": "is a directory", "code": "EISDIR"}, 400)
        if not target.is_file():
            return JSONResponse({"error": "no such file or directory", "code": "ENOENT"}, 404)
        return Response(target.read_bytes(), media_type="application/octet-stream")

    async def sessions(request: Request) -> Response:
        sprite = sprite_of(request)
        if isinstance(sprite, Response):
            return sprite
        return JSONResponse({"sessions": [s.payload() for s in sprite.sessions.values()]})

    async def exec_socket(websocket: WebSocket) -> None:
        sprite = sprite_of(websocket)
        if isinstance(sprite, Response):
            await websocket.send_denial_response(sprite)
            return
        argv = websocket.query_params.getlist("cmd")
        if not argv:
            await websocket.send_denial_response(error(400, "no_command"))
            return
        env = dict(
            item.split("=", 1) for item in websocket.query_params.getlist("env") if "=" in item
        )
        await websocket.accept()
        session = await world.start(sprite, argv, env, websocket.query_params.get("dir") or "/")
        await _serve(world, sprite, session, websocket, cut=faults.cut_stream)

    async def attach_socket(websocket: WebSocket) -> None:
        sprite = sprite_of(websocket)
        if isinstance(sprite, Response):
            await websocket.send_denial_response(sprite)
            return
        session = sprite.sessions.get(websocket.path_params["session"])
        if session is None:
            await websocket.send_denial_response(error(404, "session_not_found"))
            return
        await websocket.accept()
        await websocket.send_json({"type": "session_info", "tty": False})
        await _serve(world, sprite, session, websocket, cut=False)

    return Starlette(
        routes=[
            Route("/v1/sprites", create, methods=["POST"]),
            Route("/v1/sprites", list_sprites, methods=["GET"]),
            Route("/v1/sprites/{name}", get_sprite, methods=["GET"]),
            Route("/v1/sprites/{name}", delete_sprite, methods=["DELETE"]),
            Route("/v1/sprites/{name}/policy/network", network_policy, methods=["GET", "POST"]),
            Route("/v1/sprites/{name}/fs/write", fs_write, methods=["PUT"]),
            Route("/v1/sprites/{name}/fs/read", fs_read, methods=["GET"]),
            Route("/v1/sprites/{name}/exec", sessions, methods=["GET"]),
            WebSocketRoute("/v1/sprites/{name}/exec", exec_socket),
            WebSocketRoute("/v1/sprites/{name}/exec/{session}", attach_socket),
        ]
    )


async def _serve(
    world: World, sprite: FakeSprite, session: Session, websocket: WebSocket, *, cut: bool
) -> None:
    """Stream the session's frames until its exit; stdin frames go to the process."""
    writer = asyncio.create_task(_write(world, sprite, session, websocket, cut=cut))
    reader = asyncio.create_task(_read(session, websocket))
    session.attached = True
    try:
        await asyncio.wait([writer, reader], return_when=asyncio.FIRST_COMPLETED)
        if writer.done() and not writer.exception() and writer.result():
            # The exit frame went out: the client closes now (give it a moment).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), 2)
    finally:
        session.attached = False
        for task in (writer, reader):
            task.cancel()
        await asyncio.gather(writer, reader, return_exceptions=True)
        with contextlib.suppress(Exception):
            await websocket.close()


async def _write(
    world: World, sprite: FakeSprite, session: Session, websocket: WebSocket, *, cut: bool
) -> bool:
    """True once the exit frame is sent; False if the stream was cut or the sprite lost."""
    sent_output = False
    while True:
        changed = session.changed.current()
        while session.delivered < len(session.frames):
            if cut and sent_output:
                await websocket.close(1011)
                return False
            frame = session.frames[session.delivered]
            await websocket.send_bytes(frame)
            session.delivered += 1
            sent_output = sent_output or frame[0] == STDOUT
        if session.lost:
            await websocket.close(1011)  # the sprite went away under the command
            return False
        if session.exit_code is not None:
            await websocket.send_bytes(bytes([EXIT, session.exit_code & 0xFF]))
            sprite.sessions.pop(session.id, None)
            return True
        await changed.wait()


async def _read(session: Session, websocket: WebSocket) -> None:
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            data = await websocket.receive_bytes()
            process = session.process
            if process is None or process.stdin is None or not data:
                continue
            if data[0] == STDIN and not process.stdin.is_closing():
                with contextlib.suppress(ConnectionError):
                    process.stdin.write(data[1:])
                    await process.stdin.drain()
            elif data[0] == STDIN_EOF and not process.stdin.is_closing():
                process.stdin.close()
