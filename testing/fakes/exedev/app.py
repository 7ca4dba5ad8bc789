"""The Starlette app: ``POST /exec``, its lobby commands, and the NDJSON stream of ``ssh``.

Wire facts: ``/work/shared/reference/exedev.md`` (exedev 0.4.0 and exe.dev's docs). Every
error answers ``{"error": text}``, the shape ``exedev._errors.error_text`` reads. The texts
the SDK or a provider must match are exe.dev's (``VM "x" not found``, ``VM "x" is not
running``, ``... is already taken``); the others (a refused token, an injected failure)
carry :data:`BODY_MARKER` so tests can prove no provider body reaches a relay answer or log.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
import re
import secrets
import string
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from testing.fakes.exedev.ledger import Token
from testing.fakes.exedev.lobby import (
    FLAGS,
    TAG_SCOPED,
    CommandError,
    Invocation,
    parse,
    permitted,
    split,
)
from testing.fakes.exedev.world import FakeVM, Session, World

BODY_MARKER = "fake-exedev-body-7a41"
BAD_KEY = "bad-key"
EXEC_LIMIT = 64 * 1024
"""The largest body /exec takes (``exedev._wire.EXEC_LIMIT``)."""
VM_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9-]*\Z")  # exedev._wire._VM_NAME
EGRESS = ("all", "integrations")
Handler = Callable[[Invocation, Token], Awaitable[Response]]


def error(status: int, text: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": text}, status, headers=headers)


def refused(status: int, what: str, retry_after: str | None = "7") -> JSONResponse:
    """A refusal whose body must never reach a relay answer or log (it has the marker)."""
    headers = {"Retry-After": retry_after} if status == 429 and retry_after else None
    return error(status, f"{what} ({BODY_MARKER}, token=sk-should-never-leak)", headers)


def not_found(name: str) -> CommandError:
    return CommandError(422, f'VM "{name}" not found')


def build_app(world: World) -> Starlette:
    """The fake's one route, closed over one :class:`World`."""
    ledger, faults = world.ledger, world.faults

    def visible(token: Token, name: str) -> FakeVM:
        vm = world.vms.get(name)
        if vm is None or (token.tag is not None and token.tag not in vm.tags):
            raise not_found(name)  # a tag-scoped token sees no other VM
        return vm

    async def new(call: Invocation, token: Token) -> Response:
        if call.positionals:
            raise CommandError(422, "new: unexpected argument")
        if faults.create_status is not None:
            return refused(faults.create_status, "injected failure")
        if faults.create_hang_before_allocating:
            await world.hang.wait()
        name = call.string("name") or "".join(
            secrets.choice(string.ascii_lowercase) for _ in range(8)
        )
        if not VM_NAME.match(name):
            raise CommandError(422, f'invalid VM name "{name}"')
        if name in world.vms:
            raise CommandError(422, f'VM name "{name}" is already taken')
        tags = list(dict.fromkeys([*call.strings("tag"), *([token.tag] if token.tag else [])]))
        env: dict[str, str] = {}
        for item in call.strings("env"):
            key, has_value, value = item.partition("=")
            if not key or not has_value:
                raise CommandError(422, "new: --env takes KEY=VALUE")
            env[key] = value
        egress = call.string("egress") or "all"
        if egress not in EGRESS:
            raise CommandError(422, "new: --egress is integrations or all")
        recorded = {
            key: "(secret)" if key == "registry-auth" else value
            for key, value in call.flags.items()
            if key != "env"
        }
        vm = world.allocate(
            name,
            tags=tags,
            env=env,
            image=call.string("image") or "exeuntu",
            egress=egress,
            comment=call.string("comment") or "",
            by=token.label,
            flags=recorded,
        )
        if faults.create_allocates_then_fails:
            return refused(500, "internal error")
        if faults.create_hang:
            await world.hang.wait()  # the VM is made; its answer comes only when released
        record = vm.record()
        del record["status"], record["region"], record["region_display"]
        host = record["ssh_dest"]
        record |= {"tags": list(vm.tags), "ssh_command": f"ssh {host}", "ssh_host": host}
        return JSONResponse(record | {"ssh_port": 22, "proxy_port": 443})

    async def ls(call: Invocation, token: Token) -> Response:
        if faults.list_status is not None:
            return refused(faults.list_status, "injected failure")
        if faults.list_hang:
            await world.hang.wait()
        if len(call.positionals) > 1:
            raise CommandError(422, "ls: at most one name or pattern")
        pattern = call.positionals[0] if call.positionals else "*"
        rows = [
            vm.record()
            for name, vm in sorted(world.vms.items())
            if fnmatch.fnmatchcase(name, pattern) and (token.tag is None or token.tag in vm.tags)
        ]
        return JSONResponse({"vms": rows})

    async def rm(call: Invocation, token: Token) -> Response:
        if not call.positionals:
            raise CommandError(422, "rm: expected at least one VM name")
        if faults.terminate_hang:
            await world.hang.wait()
        if faults.take("terminate_failures"):
            return refused(500, "internal error")
        lines: list[dict[str, Any]] = []
        deleted: list[str] = []
        missing: list[str] = []
        for name in dict.fromkeys(call.positionals):
            try:
                visible(token, name)
            except CommandError as exc:
                lines.append({"error": exc.text})
                missing.append(name)
                continue
            world.delete(name, by=token.label)
            deleted.append(name)
        errors = {name: f'VM "{name}" not found' for name in missing}
        summary = {"deleted": deleted, "failed": missing, "not_found": missing, "errors": errors}
        body = "".join(json.dumps(line) + "\n" for line in [*lines, summary])
        return Response(body, media_type="application/x-ndjson")

    async def tag(call: Invocation, token: Token) -> Response:
        if len(call.positionals) < 2:
            raise CommandError(422, "tag: expected a VM and at least one tag")
        vm = visible(token, call.positionals[0])
        names = call.positionals[1:]
        if call.switch("d"):
            vm.tags = [tag for tag in vm.tags if tag not in names]
        else:
            vm.tags = list(dict.fromkeys([*vm.tags, *names]))
        return JSONResponse({"vm_name": vm.name, "tags": list(vm.tags)})

    async def egress(call: Invocation, token: Token) -> Response:
        if not 1 <= len(call.positionals) <= 2:
            raise CommandError(422, "egress: expected a VM and integrations or all")
        vm = visible(token, call.positionals[0])
        if len(call.positionals) == 2:
            if call.positionals[1] not in EGRESS:
                raise CommandError(422, "egress: the policy is integrations or all")
            vm.egress = call.positionals[1]  # commands started from now on
        return JSONResponse({"vm_name": vm.name, "egress_policy": vm.egress})

    async def restart(call: Invocation, token: Token) -> Response:
        if len(call.positionals) != 1:
            raise CommandError(422, "restart: expected one VM")
        vm = visible(token, call.positionals[0])
        world.restart(vm.name)
        return JSONResponse({"status": "restarted", "vm_name": vm.name})

    async def whoami(call: Invocation, token: Token) -> Response:
        return JSONResponse(
            {
                "email": "fake@exe.invalid",
                "region": "fake",
                "region_display": "Fake region",
                "ssh_keys": [],
            }
        )

    handlers: dict[str, Handler] = {
        "new": new,
        "ls": ls,
        "rm": rm,
        "tag": tag,
        "egress": egress,
        "restart": restart,
        "whoami": whoami,
    }
    assert set(handlers) == set(FLAGS)

    async def ssh(request: Request, words: list[str], token: Token) -> Response:
        if len(words) < 2:
            raise CommandError(422, "ssh: expected a VM name")
        vm = visible(token, words[1])
        if vm.status != "running":
            raise CommandError(422, f'VM "{vm.name}" is not running')
        command = " ".join(words[2:])  # the VM reads the rest as sshd would
        if not command:
            raise CommandError(422, "ssh: no command (the API has no stdin and no pty)")
        if "application/x-ndjson" not in request.headers.get("accept", ""):
            # The docs' other form (combined output, X-Exe-Exit trailer) is not served.
            raise CommandError(406, "this fake streams ssh output as NDJSON only")
        session = await world.start(vm, command, by=token.label)
        return CommandStream(world, session)

    async def exec_command(request: Request) -> Response:
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not bearer or bearer == BAD_KEY:
            return refused(401, "invalid token")
        token = world.token(bearer)
        if token.expires_at is not None and time.time() >= token.expires_at:
            return refused(401, "token expired")
        body = await request.body()
        verb = body.decode(errors="replace").split(maxsplit=1)[:1] or [""]
        with ledger.lock:
            ledger.requests.append({"verb": verb[0], "by": token.label})
        if faults.take("rate_limited"):  # before reading the command: nothing runs twice
            return refused(429, "rate limited", faults.retry_after)
        try:
            if len(body) > EXEC_LIMIT:
                raise CommandError(413, "the command line is longer than 64 KiB")
            try:
                words = split(body.decode())
            except UnicodeDecodeError:
                raise CommandError(422, "the command line is not UTF-8") from None
            if words[0] != "ssh" and words[0] not in handlers:
                raise CommandError(404, f'no such command "{words[0]}"')
            if not permitted(token.cmds, words) or (token.tag and words[0] not in TAG_SCOPED):
                return refused(403, f'this token may not run "{words[0]}"')
            if words[0] == "ssh":
                return await ssh(request, words, token)
            return await handlers[words[0]](parse(words), token)
        except CommandError as exc:
            return error(exc.status, exc.text)

    return Starlette(routes=[Route("/exec", exec_command, methods=["POST"])])


class CommandStream(Response):
    """An ``ssh`` answer: NDJSON lines as output comes, then the exit code or an error;
    blank lines while it is quiet. A dropped request ends the session (unless
    ``faults.commands_outlive_request``): its shell is killed, as the SDK says the VM does,
    and the SDK's ``run()`` script's watchdog then kills the command's process group."""

    def __init__(self, world: World, session: Session) -> None:
        self.world = world
        self.session = session
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = asyncio.create_task(_disconnect(receive))
        finished = False
        try:
            finished = await self._stream(send, gone)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            finished = False
        finally:
            gone.cancel()
            if not finished and not self.world.faults.commands_outlive_request:
                self.session.kill()

    async def _stream(self, send: Send, gone: asyncio.Task[None]) -> bool:
        """True once the command's end went out; False if the client left or it was cut."""
        faults = self.world.faults
        while True:
            frame = asyncio.ensure_future(self.session.frames.get())
            done, _ = await asyncio.wait(
                {frame, gone}, timeout=faults.heartbeat_s, return_when=asyncio.FIRST_COMPLETED
            )
            if frame not in done:
                frame.cancel()
                if gone in done:
                    return False
                await send({"type": "http.response.body", "body": b"\n", "more_body": True})
                continue
            kind, value = frame.result()
            if kind in ("stdout", "stderr"):
                value = base64.b64encode(value).decode()
            line = json.dumps({kind: value}).encode() + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
            if kind in ("exit_code", "error"):
                return True
            if faults.cut_stream:
                return False


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
