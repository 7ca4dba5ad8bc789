"""Thin HTTP handlers: authenticate, parse → the run service → the view → JSON.

Runs are read and written through :class:`~relay.runs.service.RunService` only; the store
is reached for ``/readyz`` alone (through the app state), and a provider only for what it
says of itself (``/v1/providers``, ``/readyz``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from relay.auth import Principal
from relay.errors import (
    Forbidden,
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
from relay.runs.models import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    Health,
    JobInfo,
    JobList,
    OperatorHealth,
    ParamInfo,
    ProviderHealth,
    ProviderInfo,
    ProviderList,
    ReaperHealth,
    RunList,
    RunRequest,
    RunState,
    SpendDay,
    SpendReport,
    TokenLimits,
    TokenSpend,
    UsageReport,
    WebhookHealth,
)
from relay.runs.service import DeliveryRecord, RunRecord
from relay.runs.view import run_model, run_summary, usage_window

MAX_JSON_DEPTH = 32
"""Deepest nesting of a request body; a run request needs four levels at most."""
RATE_LIMITED_RETRY_AFTER_S = 10.0
"""Retry-After for a rate-limited run that has no provider hint (the provider gave none,
or the run was recorded before schema 5 kept it)."""


def _json(model: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        model.model_dump_json(), status_code=status, headers=headers, media_type="application/json"
    )


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.relay
    return state


def authenticate(request: Request) -> Principal:
    state = _state(request)
    header = state.settings.auth_header
    raw = request.headers.get(header)
    if raw is not None and header.lower() == "authorization":
        scheme, _, credentials = raw.partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Unauthorized("use `Authorization: Bearer <token>`")
        raw = credentials.strip()
    principal = state.tokens.authenticate(raw)
    request.state.token_name = principal.name
    return principal


def authenticate_admin(request: Request) -> Principal:
    """The caller, who must hold an admin token (``relay tokens new NAME --admin``)."""
    principal = authenticate(request)
    if not principal.admin:
        raise Forbidden("this needs an admin token (relay tokens new NAME --admin)")
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


def _day(number: int) -> str:
    return datetime.fromtimestamp(number * 86_400, UTC).date().isoformat()


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    moment = datetime.fromtimestamp(stamp, UTC).isoformat(timespec="milliseconds")
    return moment.replace("+00:00", "Z")  # as a run's times read (relay/runs/view.py)


async def _read_request(request: Request) -> RunRequest:
    content_type = request.headers.get("content-type", "application/json")
    if content_type.split(";")[0].strip().lower() not in ("application/json", ""):
        raise UnsupportedMediaType()
    body = await request.body()
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
    try:
        return RunRequest.model_validate_json(body)
    except ValidationError as exc:
        fields = [
            {"field": ".".join(str(part) for part in err["loc"]) or "body", "message": err["msg"]}
            for err in exc.errors(include_input=False, include_url=False)
        ]
        first = fields[0]
        raise ValidationFailed(
            f"{first['field']}: {first['message']}", details={"fields": fields}
        ) from exc


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


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not key.isprintable():
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters"
        )
    return key


async def _run_json(request: Request, run: RunRecord) -> Response:
    """A run, with its deliveries, as a 200 answer."""
    found = await _state(request).service.deliveries([run])
    return _json(run_model(run, found.get(run.id)))


def _run_answer(
    request: Request, run: RunRecord, deliveries: list[DeliveryRecord] | None = None
) -> Response:
    answer = run_model(run, deliveries)
    state = _state(request)
    location = f"{state.base_url(request)}/v1/runs/{answer.id}"
    if not answer.state.final:
        return _json(answer, 202, {"Location": location})
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
    return _json(answer, 200, {"Location": location})


async def create_run(request: Request) -> Response:
    principal = authenticate(request)
    key = _idempotency_key(request)
    body = await _read_request(request)
    state = _state(request)
    limits: dict[str, str] = {}
    request.state.extra_headers = limits  # the RateLimit fields, on any answer from here on
    run, _created = await state.service.submit(principal, body, key, limits)
    if body.wait and not RunState(run.state).final:
        run = await state.service.wait(run.id, state.settings.max_wait_s)
    found = await state.service.deliveries([run])
    return _run_answer(request, run, found.get(run.id))


async def get_run(request: Request) -> Response:
    principal = authenticate(request)
    run = await _state(request).service.get(principal, request.path_params["run_id"])
    return await _run_json(request, run)


async def run_events(request: Request) -> Response:
    """The run's state changes and output as NDJSON lines, ending with the final run."""
    principal = authenticate(request)
    state = _state(request)
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
    run = await _state(request).service.cancel(principal, request.path_params["run_id"])
    return await _run_json(request, run)


async def list_runs(request: Request) -> Response:
    principal = authenticate(request)
    query = request.query_params
    known = {"state", "job", "limit", "cursor", "token", "provider", "since", "until"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r}")
    state_filter = query.get("state")
    if state_filter is not None and state_filter not in {s.value for s in RunState}:
        raise InvalidRequest(f"state must be one of {[s.value for s in RunState]}")
    try:
        limit = int(query.get("limit", "50"))
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer from 1 to 200") from exc
    if not 1 <= limit <= 200:
        raise InvalidRequest("limit must be an integer from 1 to 200")
    service = _state(request).service
    page, cursor = await service.list(
        principal,
        state=state_filter,
        job=query.get("job"),
        limit=limit,
        cursor=query.get("cursor"),
        token=query.get("token"),
        provider=query.get("provider"),
        since=_moment(query, "since"),
        until=_moment(query, "until"),
    )
    found = await service.deliveries(page)
    runs = [run_summary(run, found.get(run.id)) for run in page]
    return _json(RunList(runs=runs, next_cursor=cursor))


async def list_jobs(request: Request) -> Response:
    principal = authenticate(request)
    jobs = []
    for job in _state(request).catalog.jobs.values():
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
    return _json(JobList(jobs=jobs))


async def list_providers(request: Request) -> Response:
    authenticate(request)
    state = _state(request)
    infos = [
        ProviderInfo(
            name=name,
            enabled=True,
            isolation=getattr(provider, "isolation", None),
            limits=getattr(provider, "limits", None),
        )
        for name, provider in state.providers.items()
    ]
    return _json(ProviderList(providers=infos))


def token_limits(principal: Principal) -> TokenLimits:
    return TokenLimits(
        jobs=sorted(principal.jobs),
        command=principal.command,
        providers=sorted(principal.providers),
        max_timeout_s=principal.max_timeout_s,
        max_concurrent=principal.max_concurrent,
        runs_per_day=principal.runs_per_day,
        usd_per_day=principal.usd_per_day,
    )


async def usage(request: Request) -> Response:
    principal = authenticate(request)
    today, month = await _state(request).service.usage(principal)
    report = UsageReport(
        token=principal.name,
        today=usage_window(today),
        month=usage_window(month),
        limits=token_limits(principal),
    )
    return _json(report)


MAX_SPEND_DAYS = 92


async def spend(request: Request) -> Response:
    """Runs and USD per day, token, provider (every token's for an admin token), and
    each token's standing today against its limits."""
    principal = authenticate(request)
    state = _state(request)
    raw = request.query_params.get("days", "30")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SPEND_DAYS:
        raise InvalidRequest(f"days must be an integer from 1 to {MAX_SPEND_DAYS}")
    days = int(raw)
    first_day = int(time.time() // 86_400) - days + 1
    rows = await state.service.spend(principal, first_day * 86_400.0)
    shown = state.tokens.principals if principal.admin else [principal]
    tokens = []
    for holder in shown:
        today = await state.service.usage_today(holder.name)
        limits = token_limits(holder)
        tokens.append(
            TokenSpend(
                token=holder.name, admin=holder.admin, today=usage_window(today), limits=limits
            )
        )
    report = SpendReport(
        days=days,
        since=_day(first_day),
        rows=[
            SpendDay(
                day=_day(row.day),
                token=row.token,
                provider=row.provider,
                runs=row.runs,
                sandbox_seconds=round(row.sandbox_s, 3),
                usd=round(row.usd, 6),
            )
            for row in rows
        ],
        tokens=tokens,
    )
    return _json(report)


async def operator_health(request: Request) -> Response:
    """``/readyz``'s checks and what is behind them, for admin tokens (the console)."""
    authenticate_admin(request)
    state = _state(request)
    ready = await readyz(request)
    checks = Health.model_validate_json(bytes(ready.body))
    outcomes = await state.service.provider_outcomes(time.time() - 86_400)
    providers = []
    for name, provider in state.providers.items():
        problem = getattr(provider, "problem", None)
        runs, errors = outcomes.get(name, (0, 0))
        providers.append(
            ProviderHealth(
                name=name,
                problem=problem() if callable(problem) else None,
                runs=runs,
                errors=errors,
            )
        )
    reaper = state.reaper
    reaper_health = None
    if reaper is not None:
        reaper_health = ReaperHealth(
            last_sweep_at=_iso(reaper.last_sweep_at),
            sweeps=reaper.sweeps,
            terminated_by_reason=dict(reaper.terminated_by_reason),
            failing=len(reaper.failing),
        )
    backlog = await state.service.webhook_backlog()
    answer = OperatorHealth(
        status=checks.status,
        checks=checks.checks,
        providers=providers,
        reaper=reaper_health,
        webhooks=WebhookHealth(
            pending=backlog.pending, oldest_pending_at=_iso(backlog.oldest_created_at)
        ),
        active_runs=state.service.active_runs,
    )
    return _json(answer)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = _state(request)
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
    code = 503 if status == "unavailable" else 200
    return _json(Health(status=status, checks=checks), code)


async def openapi(request: Request) -> Response:
    from relay.http.openapi import document

    return JSONResponse(document())


routes = [
    Route("/v1/runs", create_run, methods=["POST"]),
    Route("/v1/runs", list_runs, methods=["GET"]),
    Route("/v1/runs/{run_id}", get_run, methods=["GET"]),
    Route("/v1/runs/{run_id}/events", run_events, methods=["GET"]),
    Route("/v1/runs/{run_id}", cancel_run, methods=["DELETE"]),
    Route("/v1/jobs", list_jobs, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
    Route("/v1/spend", spend, methods=["GET"]),
    Route("/v1/health", operator_health, methods=["GET"]),
    Route("/v1/providers", list_providers, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
]
