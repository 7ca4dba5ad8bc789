"""Delivery rows: the store side of webhooks (claim with a lease, record an attempt, read).

A delivery is created in the same transaction as its run's final state (see
``delivery_for_final_run`` in relay/store/database.py). Replicas share the table: a
delivery is sent only by the replica whose conditional UPDATE claimed it, and a claim
expires (its lease), so a replica that dies mid-send does not hold it forever.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from relay.store.database import Store
from relay.store.records import DeliveryRecord
from relay.store.schema import deliveries


class Deliveries:
    """Queries on the ``deliveries`` table, through the relay's one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def for_runs(self, run_ids: Sequence[str]) -> dict[str, list[DeliveryRecord]]:
        """Each run's deliveries, oldest first; runs without any are absent."""
        if not run_ids:
            return {}
        query = (
            sa.select(deliveries)
            .where(deliveries.c.run_id.in_(list(run_ids)))
            .order_by(deliveries.c.created_at, deliveries.c.id)
        )
        found: dict[str, list[DeliveryRecord]] = {}
        for row in await self.store.read(lambda conn: conn.execute(query).all()):
            found.setdefault(row.run_id, []).append(DeliveryRecord(**row._mapping))
        return found

    async def get(self, delivery_id: str) -> DeliveryRecord | None:
        query = sa.select(deliveries).where(deliveries.c.id == delivery_id)
        row = await self.store.read(lambda conn: conn.execute(query).first())
        return DeliveryRecord(**row._mapping) if row else None

    def _due(self, now: float) -> sa.ColumnElement[bool]:
        return sa.and_(
            deliveries.c.state == "pending",
            deliveries.c.next_attempt_at <= now,
            sa.or_(deliveries.c.lease_until.is_(None), deliveries.c.lease_until < now),
        )

    async def due(self, now: float, limit: int) -> list[str]:
        """Ids of pending deliveries whose time has come and that nobody holds."""
        query = (
            sa.select(deliveries.c.id)
            .where(self._due(now))
            .order_by(deliveries.c.next_attempt_at)
            .limit(limit)
        )
        return await self.store.read(lambda conn: list(conn.scalars(query)))

    async def next_due_at(self) -> float | None:
        """When the earliest pending delivery (or an expiring lease) wants attention."""
        pending = deliveries.c.state == "pending"
        wake = sa.case(
            (deliveries.c.lease_until > deliveries.c.next_attempt_at, deliveries.c.lease_until),
            else_=deliveries.c.next_attempt_at,
        )
        query = sa.select(sa.func.min(wake)).where(pending)
        value = await self.store.read(lambda conn: conn.scalar(query))
        return float(value) if value is not None else None

    async def claim(
        self, delivery_id: str, owner: str, now: float, lease_s: float
    ) -> DeliveryRecord | None:
        """Take one delivery for one attempt; None when another replica got it first.

        The claim is a single conditional UPDATE, so of several replicas exactly one
        sees a changed row. The attempt is counted here: a relay that dies mid-send has
        spent that attempt.
        """
        query = (
            deliveries.update()
            .where(deliveries.c.id == delivery_id, self._due(now))
            .values(
                lease_owner=owner,
                lease_until=now + lease_s,
                attempts=deliveries.c.attempts + 1,
            )
        )

        def work(conn: Connection) -> DeliveryRecord | None:
            if not conn.execute(query).rowcount:
                return None
            row = conn.execute(sa.select(deliveries).where(deliveries.c.id == delivery_id)).first()
            return DeliveryRecord(**row._mapping) if row else None

        return await self.store.write(work)

    async def record(
        self,
        delivery_id: str,
        owner: str,
        attempt: dict[str, Any],
        *,
        state: str,
        next_attempt_at: float,
    ) -> bool:
        """Write an attempt's outcome and release the claim (only if we still hold it)."""
        held = sa.and_(deliveries.c.id == delivery_id, deliveries.c.lease_owner == owner)

        def work(conn: Connection) -> bool:
            row = conn.execute(sa.select(deliveries.c.attempt_log).where(held)).first()
            if row is None:
                return False
            log = [*json.loads(row.attempt_log or "[]"), attempt]
            result = conn.execute(
                deliveries.update()
                .where(held)
                .values(
                    state=state,
                    attempt_log=json.dumps(log),
                    next_attempt_at=next_attempt_at,
                    lease_owner=None,
                    lease_until=None,
                )
            )
            return bool(result.rowcount)

        return await self.store.write(work)
