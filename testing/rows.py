"""Run rows as the store keeps them, for tests that put a run in the database directly
(a run another replica owns, one a dead relay left behind, one with a callback)."""

from __future__ import annotations

import time
from typing import Any

from relay.store.records import RunRecord


def run_row(run_id: str, **values: Any) -> RunRecord:
    """A running ``echo`` run of token ``ops`` on the local provider, owned by another
    replica, with a 5 s timeout; ``values`` override any column."""
    now = time.time()
    row: dict[str, Any] = {
        "id": run_id,
        "token": "ops",
        "job": "echo",
        "provider": "local",
        "state": "running",
        "request_hash": "h",
        "timeout_s": 5.0,
        "created_at": now,
        "deadline": now + 5,
        "owner": "elsewhere",
    }
    return RunRecord(**(row | values))
