"""A run's attempts: how one that failed is recorded, said in one line, and stored.

An :class:`~relay.providers.contract.Attempt` is a provider a run was tried on that did not
run its command to the end (relay/runs/route.py makes them; the run task stores them in the
run's ``attempts`` column as the API shows them, relay/runs/view.py reads them back).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence

from relay.errors import RelayError
from relay.providers.contract import Attempt


def attempt_of(name: str, sandbox_id: str | None, error: RelayError, began: float) -> Attempt:
    """An attempt on ``name`` begun at ``began`` (monotonic) that ``error`` ended now."""
    spent = time.monotonic() - began
    return Attempt(
        provider=name,
        sandbox_id=sandbox_id,
        error_code=error.code,
        error_message=error.message,
        create_ms=int(spent * 1000),
        ended_at=time.time(),
        billed_s=round(spent, 3),
    )


ENDED_MEANWHILE = "the run ended (its deadline, or a cancel) during this create"
"""An attempt's error (code ``canceled``) when its run ended while its create was under way."""

PHRASES = {
    "provider_unavailable": "unavailable",
    "provider_auth": "refused the relay's credentials",
    "provider_rate_limited": "rate limited (or over its quota)",
    "sandbox_lost": "the sandbox was lost",
}


def said(attempt: Attempt, action: str) -> str:
    """How a failed attempt reads in one line: "create timed out after 10 s"."""
    if attempt.error_code == "provider_timeout" and action == "creating the sandbox":
        # Tenths, rounded down: a create timeout of 3 s reads "3 s" however late the timer
        # fired on a busy event loop (it did time out after that long).
        return f"create timed out after {math.floor(attempt.create_ms / 100) / 10:g} s"
    phrase = PHRASES.get(attempt.error_code)
    if phrase is None:
        return attempt.error_message
    return f"{phrase} while {action}"


def attempts_json(attempts: Sequence[Attempt]) -> str:
    """The ``attempts`` column: each attempt as the API shows it (relay/runs/view.py)."""
    return json.dumps(
        [
            {
                "provider": attempt.provider,
                "sandbox_id": attempt.sandbox_id,
                "error": (
                    {"code": attempt.error_code, "message": attempt.error_message}
                    if attempt.error_code
                    else None
                ),
                "create_ms": attempt.create_ms,
                "ended_at": round(attempt.ended_at, 3),
            }
            for attempt in attempts
        ],
        separators=(",", ":"),
    )
