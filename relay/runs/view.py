"""A stored run as the API shows it: the one place that builds a :class:`Run` answer.

The handlers, the live stream of a run and the webhook dispatcher all answer with it, so a
run reads the same everywhere.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from relay.runs.models import (
    Delivery,
    DeliveryAttempt,
    ErrorInfo,
    Run,
    RunState,
    RunSummary,
    Timings,
)


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return (
        datetime.fromtimestamp(stamp, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def delivery_model(row: dict[str, Any]) -> Delivery:
    attempts = [
        DeliveryAttempt(**(entry | {"at": _iso(entry["at"]) or ""}))
        for entry in json.loads(row.get("attempt_log") or "[]")
    ]
    pending = row["state"] == "pending"
    return Delivery(
        id=row["id"],
        state=row["state"],
        attempts=attempts,
        next_attempt_at=_iso(row["next_attempt_at"]) if pending else None,
    )


def _run_fields(row: dict[str, Any], deliveries: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What a run and a run's summary share, from its stored row and delivery rows."""
    error = None
    if row.get("error_code"):
        error = ErrorInfo(
            code=row["error_code"],
            message=row.get("error_message") or "",
            retry_after_s=row.get("error_retry_after_s"),
        )
    return {
        "id": row["id"],
        "job": row["job"],
        "state": RunState(row["state"]),
        "exit_code": row.get("exit_code"),
        "stdout_truncated": bool(row.get("stdout_truncated")),
        "stderr_truncated": bool(row.get("stderr_truncated")),
        "provider": row["provider"],
        "sandbox_id": row.get("sandbox_id"),
        "timeout_s": row["timeout_s"],
        "created_at": _iso(row["created_at"]) or "",
        "started_at": _iso(row.get("started_at")),
        "ended_at": _iso(row.get("ended_at")),
        "duration_ms": row.get("duration_ms"),
        "cost_usd": row.get("cost_usd") or 0.0,
        "timings": Timings(**json.loads(row.get("timings") or "{}")),
        "error": error,
        "deliveries": [delivery_model(delivery) for delivery in deliveries or []],
    }


def run_summary(row: dict[str, Any], deliveries: list[dict[str, Any]] | None = None) -> RunSummary:
    """A listed row (no output, its sizes: ``Store.list_runs``) as a listing shows it."""
    return RunSummary(
        stdout_bytes=row.get("stdout_bytes") or 0,
        stderr_bytes=row.get("stderr_bytes") or 0,
        **_run_fields(row, deliveries),
    )


def run_model(row: dict[str, Any], deliveries: list[dict[str, Any]] | None = None) -> Run:
    """A stored row (and its delivery rows) as the API shows it (the same shape everywhere)."""
    return Run(
        stdout=row.get("stdout") or "",
        stderr=row.get("stderr") or "",
        **_run_fields(row, deliveries),
    )
