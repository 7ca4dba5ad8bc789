"""Each provider's recent create time, as the runs record it: what ``route = "fastest"``
ranks by (relay/runs/ranking.py) and ``/v1/health`` shows.

Read from the runs themselves (written with each run's final record, the attempts of a
route among them), never per run: the ranking keeps the answer in memory and asks again
at most every ``RELAY_ROUTE_LATENCY_REFRESH_S``.
"""

from __future__ import annotations

import json
import statistics

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.run_state import FINAL
from relay.store.database import Store
from relay.store.schema import runs, state_in

RECENT = 1000
"""The latest ended runs a reading weighs, at most (a bounded read of ``ix_runs_created``)."""

_RECENT = (
    sa.select(runs.c.provider, runs.c.timings, runs.c.attempts)
    .where(runs.c.created_at >= sa.bindparam("since"), runs.c.state.in_(state_in(FINAL)))
    .order_by(runs.c.created_at.desc())
    .limit(RECENT)
)


async def create_p50_ms(store: Store, since: float) -> dict[str, int]:
    """Per provider, the median create time (ms) of the runs ended since ``since`` whose
    sandbox it created (a warm pool's claim is not a create; a route's failed creates are
    not the provider's speed, they are its breaker's business)."""

    def read(conn: Connection) -> dict[str, int]:
        took: dict[str, list[int]] = {}
        for provider, timings, attempts in conn.execute(_RECENT, {"since": since}):
            create_ms = _create_ms(provider, timings, attempts)
            if create_ms is not None:
                took.setdefault(provider, []).append(create_ms)
        return {name: int(statistics.median(values)) for name, values in took.items()}

    return await store.read_aside(read)


def _create_ms(provider: str, timings: str | None, attempts: str | None) -> int | None:
    """The create time of the sandbox that ran the run, if it was created for it."""
    try:
        measured = json.loads(timings or "{}")
        tried = json.loads(attempts) if attempts else []
    except ValueError:
        return None
    if not isinstance(measured, dict) or measured.get("pooled"):
        return None
    for attempt in reversed(tried if isinstance(tried, list) else []):
        # A route's: the attempt that ran it (its provider, no error) has its own create.
        if isinstance(attempt, dict) and attempt.get("provider") == provider:
            create_ms = attempt.get("create_ms")
            error = attempt.get("error")
            return create_ms if isinstance(create_ms, int) and not error else None
    create_ms = measured.get("create_ms")
    return create_ms if isinstance(create_ms, int) else None
