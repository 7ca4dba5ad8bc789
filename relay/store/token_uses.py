"""When each token value was last used: kept in memory on a request's path, written here.

The token store (relay/auth.py) notes each authenticated value's last use in a dictionary,
which costs a request nothing the store would see. :class:`TokenUseWriter` takes what it
noted every :data:`WRITE_INTERVAL_S` and once at shutdown and writes it in one transaction,
each value's row only ever moving forward in time (several replicas write the same rows).
``relay tokens list`` reads the rows, so what it shows is at most a minute old.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from relay.store.database import Store
from relay.store.schema import token_uses

log = logging.getLogger("relay.token_uses")

WRITE_INTERVAL_S = 60.0
Uses = Mapping[str, tuple[str, float]]
"""A value's SHA-256 (hex, as in the token file) → its token's name and its last use."""


def record(conn: Connection, uses: Uses) -> None:
    """Write ``uses``, keeping the later time where a row is there already."""
    rows = [
        {"sha256": digest, "token": name, "last_used_at": at} for digest, (name, at) in uses.items()
    ]
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(token_uses)
    later = statement.excluded.last_used_at > token_uses.c.last_used_at
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=[token_uses.c.sha256],
            set_={
                "token": statement.excluded.token,
                "last_used_at": statement.excluded.last_used_at,
            },
            where=later,
        ),
        rows,
    )


def read(conn: Connection) -> dict[str, float]:
    """Every value's last use: SHA-256 (hex) → unix time."""
    found = conn.execute(sa.select(token_uses.c.sha256, token_uses.c.last_used_at))
    return {digest: at for digest, at in found}


class TokenUseWriter:
    """Writes the uses ``take`` hands over (and forgets) every ``interval_s`` and at the end;
    uses a failed write could not store are kept for the next one."""

    def __init__(
        self, store: Store, take: Callable[[], Uses], interval_s: float = WRITE_INTERVAL_S
    ) -> None:
        self.store = store
        self.take = take
        self.interval_s = interval_s
        self._pending: dict[str, tuple[str, float]] = {}

    async def write(self) -> None:
        """Write what was noted since the last write (nothing to write: no transaction)."""
        for digest, (name, at) in self.take().items():
            if digest not in self._pending or self._pending[digest][1] < at:
                self._pending[digest] = (name, at)
        if not self._pending:
            return
        pending = dict(self._pending)
        await self.store.write(lambda conn: record(conn, pending))
        self._pending.clear()

    async def run_forever(self) -> None:
        """Write every ``interval_s`` until canceled; the caller writes once more after."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.write()
            except Exception as exc:
                log.warning("token uses not written", extra={"error_class": type(exc).__name__})
