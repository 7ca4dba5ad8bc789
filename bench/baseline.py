"""The baseline: a bare Starlette endpoint on the same uvicorn settings as ``relay serve``.

``POST /v1/runs`` reads the body and answers a fixed JSON run, shaped and sized like the
relay's answer; ``POST /sleep/{seconds}`` does the same after sleeping (the baseline of
the waiting-callers benchmark). No auth, no validation, no store: what is left is the
cost of uvicorn, Starlette and the loopback itself.

Run as ``python -m bench.baseline PORT``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from relay.http.connections import OneSend
from relay.http.server import settle_heap

BODY = json.dumps(
    {
        "id": "run_0000000000000000000000000000",
        "job": "noop",
        "state": "succeeded",
        "exit_code": 0,
        "stdout": "ok\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "provider": "bench",
        "sandbox_id": "bench-000000000000",
        "timeout_s": 10.0,
        "created_at": "2026-01-01T00:00:00.000Z",
        "started_at": "2026-01-01T00:00:00.000Z",
        "ended_at": "2026-01-01T00:00:00.000Z",
        "duration_ms": 0,
        "cost_usd": 0.0,
        "timings": {"create_ms": 0, "first_output_ms": 0, "exec_ms": 0, "terminate_ms": 0},
        "error": None,
    }
).encode()


async def fixed_run(request: Request) -> Response:
    await request.body()
    return Response(BODY, media_type="application/json")


async def sleep_then_run(request: Request) -> Response:
    await request.body()
    await asyncio.sleep(float(request.path_params["seconds"]))
    return Response(BODY, media_type="application/json")


async def healthz(request: Request) -> Response:
    return Response(b'{"status": "ok"}', media_type="application/json")


app = Starlette(
    routes=[
        Route("/v1/runs", fixed_run, methods=["POST"]),
        Route("/sleep/{seconds}", sleep_then_run, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
)


class OneSendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing each answer of known length in one send, as the
    relay's connections do (relay/http/connections.py), without the relay's deadlines."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(OneSend(transport, self))  # type: ignore[arg-type]


def serve(served: Starlette, port: int, *, served_as_relay: bool = False) -> None:
    """The same uvicorn.Config as relay.cli.cmd_serve (loop and http parser on "auto").
    ``served_as_relay``: also what ``relay serve`` does for any app's speed, not the relay's
    own guarantees: one send per answer, and the collector set as
    :func:`relay.http.server.settle_heap` sets it (the floor; the bare endpoint keeps
    uvicorn's defaults)."""
    config = uvicorn.Config(
        served,
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=1,
        server_header=False,
        **({"http": OneSendProtocol} if served_as_relay else {}),
    )
    if served_as_relay:
        settle_heap()
    uvicorn.Server(config).run()


if __name__ == "__main__":
    serve(app, int(sys.argv[1]))
