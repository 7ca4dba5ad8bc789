"""A stored run as the API shows it: the one place that builds a :class:`Run` answer.

The handlers, the live stream of a run and the webhook dispatcher all answer with it, so a
run reads the same everywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from relay.run_state import RunState
from relay.runs.models import (
    Artifact,
    Delivery,
    DeliveryAttempt,
    ErrorInfo,
    RequestEcho,
    Run,
    RunAttempt,
    RunSummary,
    Timings,
    UsageWindow,
)
from relay.store.database import Usage
from relay.store.records import DeliveryRecord, RunRecord


def _iso(stamp: float | None) -> str | None:
    """``stamp`` as the API writes a time: ``datetime.fromtimestamp(stamp, UTC)`` in ISO 8601
    to the millisecond, ``Z`` for UTC. The date and time of day are formatted once a second
    (an answer has three times, mostly in one second; a listing hundreds); the microseconds
    are rounded as ``fromtimestamp`` rounds them (half to even), then cut to milliseconds as
    ``isoformat`` cuts them, so the text is the same."""
    global _last_second
    if stamp is None:
        return None
    if not math.isfinite(stamp):  # fromtimestamp's own error
        return datetime.fromtimestamp(stamp, UTC).isoformat(timespec="milliseconds")
    fraction, whole = math.modf(stamp)
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        micros -= 1_000_000
        whole += 1.0
    elif micros < 0:
        micros += 1_000_000
        whole -= 1.0
    second, text = _last_second
    if whole != second:
        text = datetime.fromtimestamp(whole, UTC).isoformat()[:-6]  # without "+00:00"
        _last_second = (whole, text)
    return f"{text}.{micros // 1000:03d}Z"


_last_second: tuple[float, str] = (math.nan, "")
"""The second :func:`_iso` formatted last, and its text (one tuple: read and replaced whole)."""


def delivery_model(delivery: DeliveryRecord) -> Delivery:
    attempts = [
        DeliveryAttempt(**(entry | {"at": _iso(entry["at"]) or ""}))
        for entry in json.loads(delivery.attempt_log or "[]")
    ]
    pending = delivery.state == "pending"
    return Delivery(
        id=delivery.id,
        state=delivery.state,
        attempts=attempts,
        next_attempt_at=_iso(delivery.next_attempt_at) if pending else None,
    )


def _attempts(
    run: RunRecord, error: ErrorInfo | None, timings: Timings, ended_at: str | None
) -> list[RunAttempt]:
    """The run's attempts: those stored (a route's, or a create that failed), and the one
    holding its sandbox when the stored ones do not name it (the first attempt ran it, or
    the run is still running, or the reaper ended it)."""
    tried = [
        RunAttempt(
            provider=entry["provider"],
            sandbox_id=entry.get("sandbox_id"),
            error=ErrorInfo(**entry["error"]) if entry.get("error") else None,
            create_ms=entry.get("create_ms"),
            ended_at=_iso(entry.get("ended_at")),
        )
        for entry in (json.loads(run.attempts) if run.attempts else ())
    ]
    if run.sandbox_id is None or any(each.sandbox_id == run.sandbox_id for each in tried):
        return tried
    ended = run.state in (RunState.error, RunState.lost)
    # Validated, though its values are checked already: pydantic's validation (in Rust)
    # costs half of ``model_construct`` (in Python), and every answer has one.
    holding = RunAttempt(
        provider=run.provider,
        sandbox_id=run.sandbox_id,
        error=error if ended else None,
        create_ms=timings.create_ms if not tried else None,
        ended_at=ended_at,
    )
    return [*tried, holding]


def _run_fields(run: RunRecord, deliveries: Sequence[DeliveryRecord] | None) -> dict[str, Any]:
    """What a run and a run's summary share, from its record and its deliveries."""
    error = None
    if run.error_code:
        error = ErrorInfo(
            code=run.error_code,
            message=run.error_message or "",
            retry_after_s=run.error_retry_after_s,
        )
    timings = Timings.model_validate_json(run.timings or "{}")  # the relay's own JSON object
    ended_at = _iso(run.ended_at)
    return {
        "id": run.id,
        "token": run.token,
        "job": run.job,
        "state": run.state,
        "exit_code": run.exit_code,
        "stdout_truncated": bool(run.stdout_truncated),
        "stderr_truncated": bool(run.stderr_truncated),
        "provider": run.provider,
        "sandbox_id": run.sandbox_id,
        "timeout_s": run.timeout_s,
        "created_at": _iso(run.created_at) or "",
        "started_at": _iso(run.started_at),
        "ended_at": ended_at,
        "duration_ms": run.duration_ms,
        "cost_usd": run.cost_usd or 0.0,
        "timings": timings,
        "error": error,
        "attempts": _attempts(run, error, timings, ended_at),
        "deliveries": [delivery_model(delivery) for delivery in deliveries or []],
    }


def run_summary(run: RunRecord, deliveries: Sequence[DeliveryRecord] | None = None) -> RunSummary:
    """A listed run (no output, its sizes; its request when short: ``Store.list_runs``) as a
    listing shows it."""
    return RunSummary(
        stdout_bytes=run.stdout_bytes or 0,
        stderr_bytes=run.stderr_bytes or 0,
        request=_echo(run.request) if run.request else None,
        **_run_fields(run, deliveries),
    )


def run_model(run: RunRecord, deliveries: Sequence[DeliveryRecord] | None = None) -> Run:
    """A stored run (and its deliveries) as the API shows it (the same shape everywhere)."""
    asked = _echo(run.request) if run.request else None
    return Run(
        stdout=run.stdout or "",
        stderr=run.stderr or "",
        request=asked,
        artifacts=artifact_models(run.id, run.artifacts),
        **_run_fields(run, deliveries),
    )


def artifact_url(run_id: str, name: str) -> str:
    """Where an artifact is read, relative to the relay: built from the run's id and the
    stored name alone, never from the request (its Host, its path)."""
    return f"/v1/runs/{run_id}/artifacts/{quote(name, safe='/')}"


def artifact_models(run_id: str, listing: str | None) -> list[Artifact]:
    """A run's artifacts column (a JSON array, relay/runs/artifacts.py) as its JSON lists
    them, each kept one with its url."""
    if not listing:
        return []
    return [
        Artifact(
            **entry,
            url=artifact_url(run_id, entry["name"]) if entry.get("sha256") else None,
        )
        for entry in json.loads(listing)
    ]


_ECHOES: dict[str, RequestEcho] = {}
MAX_ECHOES = 256
"""Requests' echoes kept parsed, by their stored text: a run is answered and polled several
times, and a scheduled job sends the same request each time. The oldest is forgotten."""
MAX_ECHO_CHARS = 4096
"""A longer echo (large params) is parsed each time, not kept."""


def _echo(text: str) -> RequestEcho:
    found = _ECHOES.get(text)
    if found is None:
        found = RequestEcho.model_validate_json(text)
        if len(text) <= MAX_ECHO_CHARS:
            if len(_ECHOES) >= MAX_ECHOES:
                del _ECHOES[next(iter(_ECHOES))]
            _ECHOES[text] = found
    return found


def usage_window(usage: Usage) -> UsageWindow:
    """A token's usage over a window (a day, a month) as ``GET /v1/usage`` shows it."""
    return UsageWindow(
        runs=usage.runs,
        sandbox_seconds=round(usage.sandbox_s, 3),
        usd=round(usage.usd, 6),
        active=usage.active,
        pool_idle_seconds=round(usage.pool_idle_s, 3),
        pool_idle_usd=round(usage.pool_idle_usd, 6),
    )
