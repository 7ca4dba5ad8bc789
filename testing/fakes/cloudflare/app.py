"""The Starlette app answering the job Worker's HTTP contract (deploy/cloudflare/openapi.yaml).

Routed as the Worker routes (deploy/cloudflare/src/index.ts): the key first, on every path
(403 when the fake has none, 401 for another), then the six operations; ids, queries and
bodies refused with the Worker's 4xx codes. ``open_auth`` makes a Worker that skips the key
altogether, as Cloudflare's Sandbox Bridge does when its key is unset: the relay must refuse
to use it. Every error is ``{"error": {"code",
"message"}}``; the message carries :data:`BODY_MARKER` so tests can prove no Worker body
reaches a relay answer or log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from testing.fakes.cloudflare import files
from testing.fakes.cloudflare.contract import (
    MAX_BODY_BYTES,
    Refused,
    check_job,
    check_run,
    egress_of,
    instance_type_for,
    job_id_ok,
)
from testing.fakes.cloudflare.job import FakeJob, iso
from testing.fakes.cloudflare.world import World

BODY_MARKER = "fake-cloudflare-body-7d2a"
BAD_KEY = "bad-key"
MIN_KEY_LENGTH = 32
_TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_JOB_PATH = re.compile(r"/v1/jobs/([^/]+)")
_EVENTS_PATH = re.compile(r"/v1/jobs/([^/]+)/events")
_RUN_PATH = re.compile(r"/v1/jobs/([^/]+)/run")
_FILES_PATH = re.compile(r"/v1/jobs/([^/]+)/files")
_FILE_PATH = re.compile(r"/v1/jobs/([^/]+)/file")
MAX_LIST = 1000


def error(status: int, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = f"{code} ({BODY_MARKER}, token=sk-should-never-leak)"
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and not (declared.isdigit() and int(declared) <= MAX_BODY_BYTES):
        raise Refused(413, "body_too_large", "the body is over 16 MiB")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise Refused(413, "body_too_large", "the body is over 16 MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def _digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _id(segment: str) -> str:
    if not job_id_ok(segment):
        raise Refused(400, "invalid_id", "not a job id")
    return segment


def _end_line(job: FakeJob) -> dict[str, Any]:
    view = job.view()
    keys = ("state", "exit_code", "error", "stdout_truncated", "stderr_truncated", "destroyed_at")
    return {"type": "end", **{key: view[key] for key in keys}}


def build_app(world: World, key: str | None, open_auth: bool = False) -> Starlette:
    """The fake Worker, closed over one :class:`World` and the key it was configured with
    (``open_auth``: a Worker that answers without one, which the relay must refuse)."""
    ledger, faults = world.ledger, world.faults

    def refusal(request: Request) -> Response | None:
        if open_auth:
            return None
        if key is None or len(key) < MIN_KEY_LENGTH:
            return error(403, "key_not_configured")
        presented = re.fullmatch(r"Bearer ([!-~]+)", request.headers.get("authorization", ""))
        with ledger.lock:
            ledger.keys.append("" if presented is None else presented.group(1))
        if presented is None or not hmac.compare_digest(
            hashlib.sha256(presented.group(1).encode()).digest(),
            hashlib.sha256(key.encode()).digest(),
        ):
            return error(401, "unauthorized", {"www-authenticate": "Bearer"})
        return None

    async def create(request: Request) -> Response:
        if faults.create_status is not None:
            status = faults.create_status
            return error(status, "injected", {"retry-after": "7"} if status == 429 else None)
        body, command = check_job(await _body(request))
        instance_type = instance_type_for(body["size"], world.deployed)
        egress = egress_of(body["egress"])
        digest = _digest(body)
        existing = world.jobs.get(body["id"])
        if existing is not None:
            if existing.digest != digest:
                return error(409, "id_conflict")
            if existing.keep:
                await existing.started.wait()
            return JSONResponse(existing.view(), 200, {"location": f"/v1/jobs/{existing.id}"})
        job = world.create(body, digest, instance_type, egress, command)
        if faults.create_allocates_then_fails:
            return error(500, "internal")
        if faults.create_hang:
            await world.hang.wait()
        if job.keep:  # a two-step job is answered once its container is up (or failed)
            await job.started.wait()
        return JSONResponse(job.view(), 201, {"location": f"/v1/jobs/{job.id}"})

    async def run(request: Request, job_id: str) -> Response:
        command = check_run(await _body(request))
        job = world.jobs.get(job_id)
        if job is None:
            return error(404, "not_found")
        outcome = await world.run(job, command, _digest(command))
        if outcome in ("started", "existing"):
            return JSONResponse(job.view(), 202 if outcome == "started" else 200)
        return error(409, "already_run" if outcome == "already_run" else "job_ended")

    def list_jobs(request: Request) -> Response:
        if faults.list_status is not None:
            return error(faults.list_status, "injected")
        wanted: list[tuple[str, str]] = []
        for tag in request.query_params.getlist("tag"):
            name, equals, value = tag.partition("=")
            if not equals or not _TAG_NAME.fullmatch(name) or len(value) > 256:
                raise Refused(400, "invalid_query", "tag takes name=value")
            wanted.append((name, value))
        limit_text = request.query_params.get("limit", "100")
        if not re.fullmatch(r"\d{1,4}", limit_text) or not 1 <= int(limit_text) <= MAX_LIST:
            raise Refused(400, "invalid_query", "limit takes 1 to 1000")
        limit = int(limit_text)
        cursor = request.query_params.get("cursor")
        after = "" if cursor is None else _id(cursor)
        found = [
            job
            for job in world.live()
            if job.id > after and all(job.body["tags"].get(n) == v for n, v in wanted)
        ]
        page = found[:limit]
        return JSONResponse(
            {
                "jobs": [
                    {
                        "id": job.id,
                        "tags": job.body["tags"],
                        "instance_type": job.instance_type,
                        "created_at": iso(job.created_at),
                        "deadline": iso(job.deadline),
                    }
                    for job in page
                ],
                "next_cursor": page[-1].id if len(found) > limit else None,
            }
        )

    async def lines(job: FakeJob, after: int) -> AsyncIterator[bytes]:
        cursor, cut = after, faults.cut_stream
        while True:
            changed = job.changed.current()
            if len(job.events) > cursor:
                for event in job.events[cursor:]:
                    yield (json.dumps(event) + "\n").encode()
                    cursor += 1
                    if cut:
                        return  # the connection drops after the first output line
                continue
            if job.final:
                yield (json.dumps(_end_line(job)) + "\n").encode()
                return
            try:
                await asyncio.wait_for(changed.wait(), world.heartbeat_s)
            except TimeoutError:
                yield b'{"type": "ping"}\n'

    def follow(request: Request, job_id: str) -> Response:
        after = request.query_params.get("after", "0")
        if not re.fullmatch(r"\d{1,9}", after):
            raise Refused(400, "invalid_query", "after takes a whole number")
        job = world.jobs.get(job_id)
        if job is None:
            return error(404, "not_found")
        return StreamingResponse(lines(job, int(after)), media_type="application/x-ndjson")

    def show(job_id: str) -> Response:
        job = world.jobs.get(job_id)
        return error(404, "not_found") if job is None else JSONResponse(job.view())

    def cancel(job_id: str) -> Response:
        if job_id not in world.jobs:
            return error(404, "not_found")
        confirmed = world.cancel(job_id)
        return JSONResponse(world.jobs[job_id].view(), 200 if confirmed else 202)

    def not_allowed(allowed: str) -> Response:
        return error(405, "method_not_allowed", {"allow": allowed})

    async def route(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        # The path as sent, not percent-decoded: as the Worker's URL.pathname sees it.
        path, method = request.scope.get("raw_path", b"").decode("latin-1"), request.method
        if path == "/v1/jobs":
            if method == "POST":
                return await create(request)
            return list_jobs(request) if method == "GET" else not_allowed("GET, POST")
        if (ran := _RUN_PATH.fullmatch(path)) is not None:
            return await run(request, _id(ran[1])) if method == "POST" else not_allowed("POST")
        for pattern, answer in ((_FILES_PATH, files.list_files), (_FILE_PATH, files.read_file)):
            if (found := pattern.fullmatch(path)) is not None:
                if method != "GET":
                    return not_allowed("GET")
                return answer(request, world.jobs.get(_id(found[1])))
        if (events := _EVENTS_PATH.fullmatch(path)) is not None:
            return follow(request, _id(events[1])) if method == "GET" else not_allowed("GET")
        if (job := _JOB_PATH.fullmatch(path)) is not None:
            if method == "GET":
                return show(_id(job[1]))
            return cancel(_id(job[1])) if method == "DELETE" else not_allowed("GET, DELETE")
        return error(404, "not_found")

    async def dispatch(request: Request) -> Response:
        try:
            return await route(request)
        except Refused as refused:
            return error(refused.status, refused.code)
        except ClientDisconnect:  # the caller went away mid-body (a relay killed mid-create)
            return Response(status_code=400)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", dispatch, methods=methods)])
