"""The fake E2B control plane: create, list, set timeout, kill (the calls the relay makes).

Shapes follow e2b 2.63.0's generated client (see shared/reference/e2b.md) and E2B's public
OpenAPI spec (``spec/openapi.yml`` of e2b-dev/infra: a listed sandbox's fields, the list's
``limit`` of 1 to 100, 404 for an unknown sandbox): error bodies are JSON ``{"code",
"message"}``; a create replaying an ``Idempotency-Key`` answers the
sandbox the key's first create made; 429/5xx answers carry ``Retry-After: 0`` so the SDK's
own retries stay fast in tests.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from testing.fakes.e2b.world import ENVD_VERSION, TEMPLATES, FakeSandbox, World

BAD_KEY = "bad-key"
MAX_PAGE = 100
"""The largest list ``limit`` E2B's API takes (its OpenAPI spec: 1 to 100, default 100)."""


def error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status, headers=headers)


def _authorized(request: Request) -> JSONResponse | None:
    key = request.headers.get("x-api-key")
    if not key or key == BAD_KEY:
        return error(401, "Invalid API key")
    return None


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def _listed(sandbox: FakeSandbox) -> dict[str, Any]:
    cpu, memory = TEMPLATES.get(sandbox.template, TEMPLATES["base"])
    return {
        "templateID": sandbox.template,
        "sandboxID": sandbox.sandbox_id,
        "clientID": "fake",
        "startedAt": _iso(sandbox.started_at),
        "endAt": _iso(sandbox.end_at),
        "cpuCount": cpu,
        "memoryMB": memory,
        "diskSizeMB": 1024,
        "state": "running",
        "envdVersion": ENVD_VERSION,
        "metadata": sandbox.metadata,
    }


def routes(world: World) -> list[Route]:
    async def create(request: Request) -> Response:
        if (denied := _authorized(request)) is not None:
            return denied
        with world.ledger.lock:
            world.ledger.create_attempts += 1
        faults = world.faults
        if faults.create_hang:
            await asyncio.Event().wait()  # never answers; the client must give up
        if faults.create_status is not None:
            return error(faults.create_status, "injected failure", **{"Retry-After": "0"})
        body = await request.json()
        if str(body.get("templateID", "")).startswith("missing"):
            return error(404, f"template '{body['templateID']}' not found")
        key = request.headers.get("idempotency-key")
        known = world.idempotency.get(key) if key else None
        with world.ledger.lock:
            replayed = world.ledger.sandboxes.get(known) if known else None
        sandbox = replayed or world.create(body)
        if key:
            world.idempotency[key] = sandbox.sandbox_id
        if faults.create_allocates_then_fails:
            return error(500, "injected failure after allocation")
        if replayed is None and faults.create_answers_lost > 0:
            faults.create_answers_lost -= 1
            return error(502, "injected: the answer was lost", **{"Retry-After": "0"})
        return JSONResponse(
            {
                "templateID": sandbox.template,
                "sandboxID": sandbox.sandbox_id,
                "clientID": "fake",
                "envdVersion": ENVD_VERSION,
                "envdAccessToken": sandbox.access_token,
            },
            201,
        )

    async def list_sandboxes(request: Request) -> Response:
        if (denied := _authorized(request)) is not None:
            return denied
        wanted: dict[str, str] = {}
        raw = request.query_params.get("metadata")
        if raw:
            for key, value in urllib.parse.parse_qsl(raw):
                wanted[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
        with world.ledger.lock:
            sandboxes = list(world.ledger.sandboxes.values())
        found = [
            _listed(s)
            for s in sorted(sandboxes, key=lambda s: s.sandbox_id)
            if all(s.metadata.get(key) == value for key, value in wanted.items())
        ]
        # Pages of `limit` (1 to 100, the API's documented bounds; capped further by
        # world.page_size), continued by the x-next-token header.
        asked = request.query_params.get("limit", str(MAX_PAGE))
        if not asked.isdigit() or not 1 <= int(asked) <= MAX_PAGE:
            return error(400, "limit must be between 1 and 100")
        limit = min(int(asked), world.page_size)
        start = int(request.query_params.get("nextToken") or 0)
        page, rest = found[start : start + limit], found[start + limit :]
        headers = {"x-next-token": str(start + limit)} if rest else {}
        return JSONResponse(page, headers=headers)

    async def set_timeout(request: Request) -> Response:
        if (denied := _authorized(request)) is not None:
            return denied
        body = await request.json()
        if not world.set_timeout(request.path_params["sandbox_id"], int(body["timeout"])):
            return error(404, "sandbox not found")
        return Response(status_code=204)

    async def kill(request: Request) -> Response:
        if (denied := _authorized(request)) is not None:
            return denied
        if world.faults.terminate_failures > 0:
            world.faults.terminate_failures -= 1
            return error(500, "injected kill failure")
        if not world.kill(request.path_params["sandbox_id"]):
            return error(404, "sandbox not found")
        return Response(status_code=204)

    async def index(request: Request) -> Response:
        # Something plain to fetch, for jobs that check the network (http-status).
        return Response("fake E2B\n", media_type="text/plain")

    return [
        Route("/", index, methods=["GET"]),
        Route("/v2/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/sandboxes/{sandbox_id}/timeout", set_timeout, methods=["POST"]),
        Route("/sandboxes/{sandbox_id}", kill, methods=["DELETE"]),
    ]
