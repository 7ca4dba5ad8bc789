"""The admin side of the API, what ``/console`` reads: spend across tokens, health, and how
runs ended per job and provider.

``GET /v1/spend`` answers any token (its own rows; an admin's: every token's);
``GET /v1/health`` and ``GET /v1/outcomes`` answer admin tokens only. All read through the
run service. ``POST /v1/jobs/reload`` (admin tokens) reloads this replica's jobs folder.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from relay.auth import Principal
from relay.errors import Forbidden, InvalidRequest, NotFound
from relay.http.routes import (
    authenticate,
    json_answer,
    readiness,
    state_of,
    token_limits,
)
from relay.run_state import RunState
from relay.runs.breakers import Breakers
from relay.runs.models import (
    MAX_OUTCOME_HOURS,
    BreakerHealth,
    ErrorInfo,
    JobsReload,
    LastFailure,
    OperatorHealth,
    Outcome,
    OutcomeReport,
    PoolHealth,
    ProviderHealth,
    ReaperHealth,
    SkippedPool,
    SpendDay,
    SpendReport,
    TokenSpend,
    WebhookHealth,
)
from relay.runs.pools import Pools
from relay.runs.service import GroupOutcome
from relay.runs.view import usage_window


def authenticate_admin(request: Request) -> Principal:
    """The caller, who must hold an admin token (``relay tokens new NAME --admin``)."""
    principal = authenticate(request)
    if not principal.admin:
        raise Forbidden("this needs an admin token (relay tokens new NAME --admin)")
    return principal


def _day(number: int) -> str:
    return datetime.fromtimestamp(number * 86_400, UTC).date().isoformat()


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    moment = datetime.fromtimestamp(stamp, UTC).isoformat(timespec="milliseconds")
    return moment.replace("+00:00", "Z")  # as a run's times read (relay/runs/view.py)


MAX_SPEND_DAYS = 92


def _whole_number(request: Request, name: str, default: str, most: int) -> int:
    raw = request.query_params.get(name, default)
    # ASCII first: "²" is a digit to str.isdigit, and int() then raises (a 500).
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"{name} must be an integer from 1 to {most}")
    return int(raw)


async def spend(request: Request) -> Response:
    """Runs and USD per day, token, provider (every token's for an admin token), and
    each token's standing today against its limits."""
    principal = authenticate(request)
    state = state_of(request)
    days = _whole_number(request, "days", "30", MAX_SPEND_DAYS)
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
    return json_answer(report)


async def operator_health(request: Request) -> Response:
    """``/readyz``'s checks and what is behind them, for admin tokens (the console)."""
    authenticate_admin(request)
    state = state_of(request)
    checks = await readiness(state)
    outcomes = await state.service.provider_outcomes(time.time() - 86_400)
    create_p50_ms = await state.service.ranking.fresh()
    providers = []
    for name, provider in state.providers.items():
        problem = getattr(provider, "problem", None)
        runs, errors, failed = outcomes.get(name, (0, 0, 0))
        providers.append(
            ProviderHealth(
                name=name,
                problem=problem() if callable(problem) else None,
                breaker=breaker_health(state.service.breakers, name),
                create_p50_ms=create_p50_ms.get(name),
                max_concurrent=state.service.capacity.caps.get(name),
                runs=runs,
                errors=errors,
                failed=failed,
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
        pools=_pool_health(state.service.pools),
    )
    return json_answer(answer)


async def outcomes(request: Request) -> Response:
    """How every token's runs of the last ``hours`` ended, per job and per provider."""
    authenticate_admin(request)
    unknown = sorted(set(request.query_params) - {"hours"})
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r}")
    hours = _whole_number(request, "hours", "24", MAX_OUTCOME_HOURS)
    service = state_of(request).service
    until = time.time()
    since = until - hours * 3600
    jobs, providers = await asyncio.gather(
        service.outcomes("job", since, until), service.outcomes("provider", since, until)
    )
    report = OutcomeReport(
        hours=hours,
        since=_iso(since) or "",
        until=_iso(until) or "",
        jobs=[_outcome(group) for group in jobs.groups],
        providers=[_outcome(group) for group in providers.groups],
        omitted=jobs.omitted,
    )
    return json_answer(report)


def _outcome(group: GroupOutcome) -> Outcome:
    ended = group.succeeded + group.failed
    last = group.last_failure
    last_failure = None
    if last is not None:
        error = None
        if last.error_code:
            error = ErrorInfo(code=last.error_code, message=last.error_message or "")
        last_failure = LastFailure(
            run_id=last.run_id,
            state=RunState(last.state),
            created_at=_iso(last.created_at) or "",
            exit_code=last.exit_code,
            error=error,
        )
    return Outcome(
        name=group.name,
        runs=group.runs,
        active=group.active,
        succeeded=group.succeeded,
        failed=group.failed,
        canceled=group.canceled,
        success_rate=round(group.succeeded / ended, 4) if ended else None,
        failures=group.causes,
        p50_ms=group.duration_ms.get(50),
        p95_ms=group.duration_ms.get(95),
        usd=round(group.usd, 6),
        last_failure=last_failure,
    )


def breaker_health(breakers: Breakers, name: str) -> BreakerHealth:
    """``name``'s breaker on this replica, as ``/v1/health`` shows it."""
    breaker = breakers.of(name)
    opened_at = None
    if breaker.opened_at is not None:  # the breakers' clock is monotonic
        opened_at = _iso(time.time() - (breakers.clock() - breaker.opened_at))
    return BreakerHealth(
        state=breakers.state(name).value,
        consecutive_failures=breaker.consecutive,
        opened=breaker.opened,
        opened_at=opened_at,
        cooldown_left_s=round(breakers.cooldown_left(name), 1),
        attempts=dict(breaker.attempts),
        failovers=dict(breaker.failovers),
    )


def _pool_health(pools: Pools) -> PoolHealth:
    stats = pools.stats
    return PoolHealth(
        size=pools.size,
        ready=pools.ready,
        created=stats.created,
        claimed=stats.claimed,
        expired=stats.expired,
        failed=stats.failed,
        idle_seconds=round(stats.idle_s, 3),
        idle_usd=round(stats.idle_usd, 6),
        skipped=[
            SkippedPool(job=skip.job, provider=skip.provider, reason=skip.reason)
            for skip in pools.skipped.values()
        ],
    )


async def reload_jobs(request: Request) -> Response:
    """Read this replica's jobs folder again and serve it if it loads (``relay jobs
    reload``); else ``422 jobs_invalid`` naming the file and the problem, the last good
    jobs serving on."""
    authenticate_admin(request)
    if request.query_params:
        raise InvalidRequest("this takes no query parameters")
    jobs = state_of(request).jobs
    if jobs is None:  # pragma: no cover - the app always has one
        raise NotFound("no jobs folder on this relay")
    done = await jobs.reload()
    return json_answer(
        JobsReload(
            jobs=list(done.jobs),
            added=list(done.added),
            changed=list(done.changed),
            removed=list(done.removed),
            warnings=list(done.warnings),
        )
    )


operator_routes = [
    Route("/v1/spend", spend, methods=["GET"]),
    Route("/v1/health", operator_health, methods=["GET"]),
    Route("/v1/outcomes", outcomes, methods=["GET"]),
    Route("/v1/jobs/reload", reload_jobs, methods=["POST"]),
]
