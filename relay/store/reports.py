"""What an operator reads of every token at once: spend per day, and the webhook backlog.

Read-only queries for the admin side of the API (``GET /v1/spend``, ``GET /v1/health``),
which the console draws. A day is a UTC day, as the daily limits count it
(relay/store/limits.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.run_state import FAILURES, RunState
from relay.store.database import Store
from relay.store.schema import deliveries, runs, state_in

DAY_S = 86_400


@dataclass(frozen=True)
class SpendRow:
    """One token's runs on one provider on one UTC day (``day``: days since the epoch)."""

    day: int
    token: str
    provider: str
    runs: int
    sandbox_s: float
    usd: float


@dataclass(frozen=True)
class Backlog:
    """Webhook deliveries not yet delivered nor given up, and the oldest one's creation."""

    pending: int
    oldest_created_at: float | None


class Reports:
    """Store queries across every token (the admin scope's reading)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def spend(self, since: float, token: str | None = None) -> list[SpendRow]:
        """Runs, sandbox seconds and USD created since ``since``, per day, token and
        provider (one token's only, with ``token``), oldest day first."""

        def work(conn: Connection) -> list[SpendRow]:
            days = runs.c.created_at / DAY_S
            if conn.dialect.name == "postgresql":  # its CAST rounds; SQLite's truncates
                days = sa.func.floor(days)
            day = sa.cast(days, sa.BigInteger).label("day")
            query = (
                sa.select(
                    day,
                    runs.c.token,
                    runs.c.provider,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(runs.c.sandbox_s), 0.0),
                    sa.func.coalesce(sa.func.sum(runs.c.cost_usd), 0.0),
                )
                .where(runs.c.created_at >= since)
                .group_by(day, runs.c.token, runs.c.provider)
                .order_by(day, runs.c.token, runs.c.provider)
            )
            if token is not None:
                query = query.where(runs.c.token == token)
            return [
                SpendRow(int(d), t, p, int(n), float(s), float(u))
                for d, t, p, n, s, u in conn.execute(query)
            ]

        return await self.store.read_aside(work)

    async def provider_outcomes(self, since: float) -> dict[str, tuple[int, int, int]]:
        """Per provider: runs created since ``since``, how many of them ended in ``error``
        or ``lost`` (the provider's or the relay's fault), and how many ended in any
        failure (those, and ``failed``, ``timed_out``: the job's exit or its timeout)."""
        errors = runs.c.state.in_(state_in((RunState.error, RunState.lost)))
        failures = runs.c.state.in_(state_in(FAILURES))
        query = sa.select(
            runs.c.provider,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(sa.case((errors, 1), else_=0)), 0),
            sa.func.coalesce(sa.func.sum(sa.case((failures, 1), else_=0)), 0),
        ).where(runs.c.created_at >= since)
        query = query.group_by(runs.c.provider)

        def work(conn: Connection) -> dict[str, tuple[int, int, int]]:
            return {name: (int(n), int(e), int(f)) for name, n, e, f in conn.execute(query)}

        return await self.store.read_aside(work)

    async def webhook_backlog(self) -> Backlog:
        query = sa.select(sa.func.count(), sa.func.min(deliveries.c.created_at)).where(
            deliveries.c.state == "pending"
        )
        count, oldest = await self.store.read(lambda conn: conn.execute(query).one())
        return Backlog(int(count), float(oldest) if oldest is not None else None)
