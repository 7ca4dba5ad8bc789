"""Thin HTTP handlers: authenticate, parse → the run service → the view → JSON.

Runs are read and written through :class:`~relay.runs.service.RunService` only; the store
is reached for ``/readyz`` alone (through the app state), and a provider only for what it
says of itself (``/v1/providers``, ``/readyz``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from relay.auth import Principal
from relay.errors import (
    InvalidJson,
    InvalidRequest,
    NotFound,
    ProviderError,
    ProviderRateLimited,
    Unauthorized,
    UnsupportedMediaType,
    ValidationFailed,
    error_for_code,
)
from relay.http.app_state import AppState
from relay.http.metrics import metrics_endpoint
from relay.http.run_stream import follow_run
from relay.run_state import RunState
from relay.runs.models import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_SEARCH_CHARS,
    Health,
    JobInfo,
    JobList,
    ParamInfo,
    ProviderInfo,
    ProviderList,
    RunList,
    RunRequest,
    TokenLimits,
    UsageReport,
)
from relay.runs.service import DeliveryRecord, RunRecord
from relay.runs.view import run_model, run_summary, usage_window

MAX_FILTER_CHARS = 255
"""Longest ``job``, ``token``, ``provider`` or ``cursor`` of ``GET /v1/runs``."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of a request body; a run request needs four levels at most."""
RATE_LIMITED_RETRY_AFTER_S = 10.0
"""Retry-After for a rate-limited run that has no provider hint (the provider gave none,
or the run was recorded before schema 5 kept it)."""


def json_answer(model: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``model`` (pydantic) as a JSON answer: the bytes ``model_dump_json`` writes, taken as
    the serializer writes them, not decoded to a string that the answer encodes again."""
    return JsonAnswer(model.__pydantic_serializer__.to_json(model), status, headers)


class JsonAnswer(Response):
    """A JSON body as ``Response(body, status, headers, media_type="application/json")``
    answers it, its head put together at once: the given headers (names lower-cased), then
    ``content-length`` and ``content-type``. Every run's answer is one; Starlette's general
    way (looking for those two among the given headers, a status without a body) cost twice
    this (``timeit``). A status or header where that way differs goes that way."""

    media_type = "application/json"

    def __init__(self, body: bytes, status: int = 200, headers: dict[str, str] | None = None):
        raw = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in (headers or {}).items()
        ]
        if status < 200 or status in (204, 304) or any(name in _OWN_FIELDS for name, _ in raw):
            super().__init__(body, status, headers)
            return
        self.status_code = status
        self.background = None
        self.body = body
        raw += [(b"content-length", str(len(body)).encode("latin-1")), _JSON_TYPE]
        self.raw_headers = raw


_OWN_FIELDS = (b"content-length", b"content-type")
_JSON_TYPE = (b"content-type", b"application/json")


def state_of(request: Request) -> AppState:
    state: AppState = request.app.state.relay
    return state


def presented_token(request: Request, state: AppState | None = None) -> str | None:
    """The token the request carries (``RELAY_AUTH_HEADER``), unchecked; None if none."""
    header = (state or state_of(request)).settings.auth_header
    return token_in(request.headers.get(header), header)


def first_headers(scope: Scope) -> dict[bytes, bytes]:
    """A request's headers by name (lower-case, as the server gives them), each name's first
    value, as Starlette's ``Headers.get`` finds it: one dict for the look-ups of a run's
    request, where each of ``Headers.get``'s walks the list (and raises and catches a
    ``KeyError`` for a header that is not there)."""
    return dict(reversed(scope["headers"]))


def token_in(raw: str | None, header: str) -> str | None:
    """The token in ``raw``, the value of the request's header ``header`` (None if it has
    none): under ``Authorization``, the credentials of its ``Bearer`` scheme."""
    if raw is not None and header.lower() == "authorization":
        scheme, _, credentials = raw.partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthorized("use `Authorization: Bearer <token>`")
        raw = credentials.strip()
    return raw


def authenticate(request: Request, state: AppState | None = None) -> Principal:
    state = state or state_of(request)
    principal = state.tokens.authenticate(presented_token(request, state))
    request.state.token_name = principal.name
    return principal


def _moment(query: Any, name: str) -> float | None:
    """A query parameter holding an ISO 8601 time (UTC when it names no zone)."""
    value = query.get(name)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise InvalidRequest(f"{name} must be an ISO 8601 time, like 2026-01-31T12:00:00Z") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


async def _read_request(request: Request, headers: dict[bytes, bytes]) -> RunRequest:
    content_type = headers.get(b"content-type", b"application/json").decode("latin-1")
    if content_type.split(";")[0].strip().lower() not in ("application/json", ""):
        raise UnsupportedMediaType()
    body = await body_of(request)
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH:
        _check_shape(body)  # it may nest too deep: looked at before the model parses it
    try:
        return RunRequest.model_validate_json(body)
    except ValidationError as exc:
        # Not a JSON object, or not JSON at all, says so first. A body the model took needs
        # no other look: its parser accepts nothing Python's refuses, and a body of so few
        # brackets cannot nest too deep.
        _check_shape(body)
        raise validation_failed(exc) from exc


async def body_of(request: Request) -> bytes:
    """The request's body, read as ``Request.body`` reads it (and kept where it keeps it),
    without the async generator it reads through: a run's body is one message, and the
    generator cost twice the read (3.5-4.7 against 1.4-1.5 us, ``timeit``)."""
    chunks: list[bytes] = []
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
    body = request._body = b"".join(chunks)
    return body


def validation_failed(exc: ValidationError) -> ValidationFailed:
    """A request the models refused, as the API answers it (``422 validation_error``): the
    first field's complaint in the message, every field's in ``fields``, never the input.
    The one formatter of a refused request (the MCP tools' arguments too)."""
    fields = [
        {
            "field": ".".join(str(part) for part in err["loc"]) or "body",
            "message": err["msg"].removeprefix("Value error, "),  # our own validators' text
        }
        for err in exc.errors(include_input=False, include_url=False)
    ]
    first = fields[0]
    return ValidationFailed(f"{first['field']}: {first['message']}", details={"fields": fields})


def _check_shape(body: bytes) -> None:
    """Refuse a body that is not JSON, not an object, or nests deeper than allowed."""
    try:
        data = json.loads(body)
    except RecursionError as exc:
        raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # not JSON, not UTF-8, or a number too long to convert
        raise InvalidJson() from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels")


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar is 0), without recursion."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _idempotency_key(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"idempotency-key")
    if raw is None:
        return None
    key = raw.decode("latin-1")
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not key.isprintable():
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters"
        )
    return key


async def _run_json(request: Request, run: RunRecord) -> Response:
    """A run, with its deliveries, as a 200 answer."""
    found = await state_of(request).service.deliveries([run])
    return json_answer(run_model(run, found.get(run.id)))


def _run_answer(
    request: Request,
    run: RunRecord,
    deliveries: list[DeliveryRecord] | None = None,
    state: AppState | None = None,
) -> Response:
    answer = run_model(run, deliveries)
    state = state or state_of(request)
    location = f"{state.base_url(request)}/v1/runs/{answer.id}"
    if not answer.state.final:
        return json_answer(answer, 202, {"Location": location})
    if answer.state == RunState.error and answer.error is not None:
        error = error_for_code(answer.error.code)
        if issubclass(error, ProviderError):
            # The request did not succeed: answer with the provider fault's status, and
            # name the run so the caller can still read it.
            retry_after = answer.error.retry_after_s
            if retry_after is None and issubclass(error, ProviderRateLimited):
                retry_after = RATE_LIMITED_RETRY_AFTER_S
            raise error(
                answer.error.message,
                details={"run_id": answer.id},
                headers={"Location": location},
                retry_after=retry_after,
            )
    return json_answer(answer, 200, {"Location": location})


async def create_run(request: Request, headers: dict[bytes, bytes] | None = None) -> Response:
    """``POST /v1/runs``; ``headers``: the request's :func:`first_headers`, when the caller
    (:class:`~relay.http.app.RequestContext`) has them already."""
    if headers is None:
        headers = first_headers(request.scope)
    state = state_of(request)
    header = state.settings.auth_header
    raw = headers.get(header.lower().encode("latin-1"))
    principal = state.tokens.authenticate(
        token_in(None if raw is None else raw.decode("latin-1"), header)
    )
    # What ``authenticate`` and ``request.state`` write, written straight into the scope.
    scope_state = request.scope.setdefault("state", {})
    scope_state["token_name"] = principal.name
    key = _idempotency_key(headers)
    body = await _read_request(request, headers)
    limits: dict[str, str] = {}
    scope_state["extra_headers"] = limits  # the RateLimit fields, on any answer from here on
    service = state.service
    run, _created = await service.submit(principal, body, key, limits)
    if body.wait and not run.state.final:
        run = await service.wait(run.id, state.settings.max_wait_s)
    # Only a run with a callback has deliveries (``RunService.deliveries``): no look for one
    # without.
    found = await service.deliveries([run]) if run.callback_url else {}
    return _run_answer(request, run, found.get(run.id), state)


async def get_run(request: Request) -> Response:
    principal = authenticate(request)
    run = await state_of(request).service.get(principal, request.path_params["run_id"])
    return await _run_json(request, run)


async def get_artifact(request: Request) -> Response:
    """One artifact of a run, streamed from the store a chunk at a time (the run's own auth),
    always as an attachment: a job's file is never rendered as a page of the relay's."""
    principal = authenticate(request)
    service = state_of(request).service
    entry, info = await service.artifact(
        principal, request.path_params["run_id"], request.path_params["name"]
    )
    headers = {
        "Content-Length": str(info.size),
        "Content-Disposition": attachment(entry.name.rpartition("/")[2]),
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox",
        "ETag": f'"{info.sha256}"',
    }
    return StreamingResponse(
        service.artifact_chunks(info), media_type=entry.content_type, headers=headers
    )


def attachment(filename: str) -> str:
    """A Content-Disposition naming ``filename`` (RFC 6266: an ASCII fallback, then the
    name itself percent-encoded as UTF-8)."""
    fallback = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\%' else "_" for c in filename
    )
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


async def run_events(request: Request) -> Response:
    """The run's state changes and output as NDJSON lines, ending with the final run."""
    principal = authenticate(request)
    state = state_of(request)
    run = await state.service.get(principal, request.path_params["run_id"])
    if state.live is None:  # pragma: no cover - the app always builds one
        raise NotFound("live output is not available on this relay")
    release = state.live.hold_stream(principal.name)  # 429 past the token's cap
    return HeldStream(
        follow_run(state.live, state.service, run),
        release,
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


class HeldStream(StreamingResponse):
    """A streaming answer that releases what it holds (a token's stream slot) however it
    ends: finished, the caller gone before the first line, or failed."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], **options: Any):
        super().__init__(content, **options)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def cancel_run(request: Request) -> Response:
    principal = authenticate(request)
    run = await state_of(request).service.cancel(principal, request.path_params["run_id"])
    return await _run_json(request, run)


async def list_runs(request: Request) -> Response:
    principal = authenticate(request)
    query = request.query_params
    known = {"state", "job", "limit", "cursor", "token", "provider", "since", "until", "q"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r}")
    for name in ("job", "token", "provider", "cursor"):
        value = query.get(name)
        # A NUL is no name, and PostgreSQL refuses it in a query (a store error, not a 4xx).
        if value is not None and (len(value) > MAX_FILTER_CHARS or not value.isprintable()):
            raise InvalidRequest(f"{name} must be at most {MAX_FILTER_CHARS} printable characters")
    states = _states(query.get("state"))
    search = query.get("q")
    if search is not None and (len(search) > MAX_SEARCH_CHARS or not search.isprintable()):
        raise InvalidRequest(f"q must be at most {MAX_SEARCH_CHARS} printable characters")
    try:
        limit = int(query.get("limit", "50"))
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer from 1 to 200") from exc
    if not 1 <= limit <= 200:
        raise InvalidRequest("limit must be an integer from 1 to 200")
    service = state_of(request).service
    page, cursor = await service.list(
        principal,
        state=states,
        job=query.get("job"),
        limit=limit,
        cursor=query.get("cursor"),
        token=query.get("token"),
        provider=query.get("provider"),
        since=_moment(query, "since"),
        until=_moment(query, "until"),
        search=search or None,
    )
    found = await service.deliveries(page)
    runs = [run_summary(run, found.get(run.id)) for run in page]
    return json_answer(RunList(runs=runs, next_cursor=cursor))


def _states(raw: str | None) -> tuple[str, ...] | None:
    """``state=``: one state, or several separated by commas (any of them)."""
    if raw is None:
        return None
    names = tuple(dict.fromkeys(raw.split(",")))
    known = [state.value for state in RunState]
    if not all(name in known for name in names):
        raise InvalidRequest(f"state must be one or more of {known}, separated by commas")
    return names


async def list_jobs(request: Request) -> Response:
    principal = authenticate(request)
    jobs = []
    for job in state_of(request).catalog.jobs.values():
        if not principal.may_run_job(job.name):
            continue
        params = [
            ParamInfo(
                name=p.name,
                type=p.type,
                required=p.required,
                description=p.description,
                default=p.default,
            )
            for p in job.params.values()
        ]
        jobs.append(
            JobInfo(
                name=job.name,
                description=job.description,
                provider=job.provider,
                timeout_s=job.timeout_s,
                egress=list(job.egress),
                params=params,
            )
        )
    return json_answer(JobList(jobs=jobs))


async def list_providers(request: Request) -> Response:
    authenticate(request)
    state = state_of(request)
    infos = [
        ProviderInfo(
            name=name,
            enabled=True,
            isolation=getattr(provider, "isolation", None),
            limits=getattr(provider, "limits", None),
        )
        for name, provider in state.providers.items()
    ]
    return json_answer(ProviderList(providers=infos))


def token_limits(principal: Principal) -> TokenLimits:
    return TokenLimits(
        jobs=sorted(principal.jobs),
        command=principal.command,
        providers=sorted(principal.providers),
        max_timeout_s=principal.max_timeout_s,
        max_concurrent=principal.max_concurrent,
        runs_per_day=principal.runs_per_day,
        usd_per_day=principal.usd_per_day,
        max_artifact_bytes=principal.max_artifact_bytes,
    )


async def usage(request: Request) -> Response:
    principal = authenticate(request)
    today, month = await state_of(request).service.usage(principal)
    report = UsageReport(
        token=principal.name,
        today=usage_window(today),
        month=usage_window(month),
        limits=token_limits(principal),
    )
    return json_answer(report)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    health = await readiness(state_of(request))
    return json_answer(health, 503 if health.status == "unavailable" else 200)


async def readiness(state: AppState) -> Health:
    """What ``/readyz`` answers (and ``GET /v1/health`` shows): each check and the whole."""
    checks: dict[str, str] = {}
    status = "ok"
    try:
        await state.store.ping()
        checks["store"] = "ok"
    except Exception:
        checks["store"] = "unreachable"
        status = "unavailable"
    if status == "ok" and not await state.store.can_write(state.service.instance_id):
        checks["store"] = "not writable"
        status = "unavailable"
    # A store may take the heartbeat's one-row write and refuse a run's output (a disk
    # with room for the one, not the other): a final write it refuses is one it cannot take.
    refused = state.service.refused_final_writes
    if status == "ok" and refused:
        checks["store"] = f"refusing final writes ({refused} run(s) waiting)"
        status = "unavailable"
    if not state.service.accepting:
        checks["relay"] = "draining"
        status = "unavailable"
    for name, provider in state.providers.items():
        problem = getattr(provider, "problem", None)
        found = problem() if callable(problem) else None
        if found:
            checks[name] = found
            status = "unavailable"
    state.tokens.refresh()
    if state.tokens.problem is not None:
        checks["tokens"] = state.tokens.problem
        status = "unavailable"
    else:
        checks["tokens"] = "ok"
    if state.reaper is not None and state.reaper.degraded:
        checks["reaper"] = f"{len(state.reaper.failing)} sandbox(es) failed to terminate"
        status = "degraded" if status == "ok" else status
    if state.jobs is not None:
        # A folder that did not reload leaves the last good jobs serving: still ready.
        problem = state.jobs.problem
        checks["jobs"] = "ok" if problem is None else f"{RELOAD_FAILED}: {problem}"
        if problem is not None and status == "ok":
            status = "degraded"
    return Health(status=status, checks=checks)


RELOAD_FAILED = "the last reload failed, the last good jobs serve on"
"""How ``/readyz``'s ``jobs`` check starts when the jobs folder did not reload."""


async def openapi(request: Request) -> Response:
    from relay.http.openapi import document

    return JSONResponse(document())


CREATE_RUN = Route("/v1/runs", create_run, methods=["POST"])
"""``POST /v1/runs``, the route every run comes by: :class:`~relay.http.app.RequestContext`
serves it without the router (the route stays in :data:`routes` for everything else)."""

routes = [
    CREATE_RUN,
    Route("/v1/runs", list_runs, methods=["GET"]),
    Route("/v1/runs/{run_id}", get_run, methods=["GET"]),
    Route("/v1/runs/{run_id}/events", run_events, methods=["GET"]),
    Route("/v1/runs/{run_id}/artifacts/{name:path}", get_artifact, methods=["GET"]),
    Route("/v1/runs/{run_id}", cancel_run, methods=["DELETE"]),
    Route("/v1/jobs", list_jobs, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
    Route("/v1/providers", list_providers, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
]
