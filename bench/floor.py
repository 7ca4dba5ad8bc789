"""The floor: the least any relay built on this stack must do for a run, done the cheapest way.

``POST /v1/runs`` looks the bearer token's SHA-256 up in a dict, validates the body as
:class:`relay.runs.models.RunRequest`, admits the run through the relay's own
:class:`relay.store.database.Store` (the global run limit counted in the database, then the
INSERT), writes its final state (the conditional UPDATE), and answers the run as
:class:`relay.runs.models.Run` JSON. The same uvicorn settings as the baseline and the relay,
and served as the relay serves any app for speed (since issue 42's third pass: each answer
in one send, the collector's youngest generation every 10,000 allocations), so that what
the relay saves there is not counted as its own work saved.

What it leaves out is what makes it a relay: the catalog and the plan, the run's own task
(which outlives a caller that hangs up), the provider's context, the timeouts, the log
lines, the metrics, the events for streams, the request ids. The gap between this row
and the relay's in bench/RESULTS.md is what those cost; the gap between this row and the
bare endpoint is what the stack itself (pydantic, SQLAlchemy Core, SQLite) costs.

Run as ``python -m bench.floor PORT DATABASE TOKEN [plain]`` (``DATABASE``: a SQLite file, or
a PostgreSQL URL for the ``floor (PostgreSQL)`` row; ``plain``: on uvicorn's defaults, as
before that pass, for the row beside it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import sys
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.baseline import serve
from relay.run_state import RunState
from relay.runs.models import RunRequest
from relay.runs.view import run_model
from relay.store.database import Store
from relay.store.limits import Admission
from relay.store.records import RunRecord, RunValues

TOKENS: dict[str, str] = {}


async def create_run(request: Request) -> Response:
    header = request.headers.get("authorization", "")
    name = TOKENS.get(hashlib.sha256(header.removeprefix("Bearer ").encode()).hexdigest())
    if name is None:
        return Response(b'{"error": {"code": "unauthorized"}}', 401)
    body = RunRequest.model_validate_json(await request.body())
    store: Store = request.app.state.store
    now = time.time()
    run_id = f"run_{int(now * 1000):011x}{secrets.token_hex(8)}"
    run = RunRecord(**{
        "id": run_id,
        "token": name,
        "job": body.job,
        "provider": "bench",
        "state": "starting",
        "idempotency_key": None,
        "request_hash": "",
        "timeout_s": 30.0,
        "cpu": 1.0,
        "memory_mb": 1024,
        "created_at": now,
        "deadline": now + 60,
        "reserved_usd": 0.0,
        "owner": "floor",
        "stdout": "",
        "stderr": "",
        "timings": "{}",
        "callback_url": None,
    })  # fmt: skip
    await store.admit_run(run, Admission(None, 100_000, None, None, now))
    final: RunValues = {
        "state": RunState.succeeded,
        "exit_code": 0,
        "sandbox_id": "floor",
        "started_at": now,
        "ended_at": time.time(),
        "stdout": "ok\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "duration_ms": 0,
        "timings": "{}",
        "sandbox_s": 0.0,
        "cost_usd": 0.0,
    }
    await store.finish_run(run_id, final, callback=False)
    answer = run_model(dataclasses.replace(run, **final))
    return Response(answer.model_dump_json(), media_type="application/json")


async def healthz(request: Request) -> Response:
    return Response(b'{"status": "ok"}', media_type="application/json")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    database = sys.argv[2]  # a SQLite file, or a database URL (the PostgreSQL row)
    app.state.store = await Store.open(database if "://" in database else f"sqlite:///{database}")
    try:
        yield
    finally:
        await app.state.store.close()


app = Starlette(
    routes=[
        Route("/v1/runs", create_run, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ],
    lifespan=lifespan,
)


if __name__ == "__main__":
    TOKENS[hashlib.sha256(sys.argv[3].encode()).hexdigest()] = "bench"
    serve(app, int(sys.argv[1]), served_as_relay=sys.argv[4:] != ["plain"])
