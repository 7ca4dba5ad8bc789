"""The limits policy: which limits a token's new run is admitted under, and what a caller
is told when one refuses it.

The limits are decided in the database, in the transaction that inserts the run
(relay/store/limits.py), which raises :class:`~relay.store.limits.LimitReached`; the run
service turns that into the 429 here, once.
"""

from __future__ import annotations

from relay.auth import Principal
from relay.errors import BudgetExceeded, RateLimited
from relay.settings import Settings
from relay.store.limits import Admission, LimitReached


def admission_for(principal: Principal, settings: Settings, now: float) -> Admission:
    """The limits a run of ``principal`` submitted at ``now`` is admitted under."""
    return Admission(
        token_concurrent=principal.max_concurrent,
        global_concurrent=settings.max_concurrent,
        runs_per_day=principal.runs_per_day,
        usd_per_day=principal.usd_per_day,
        now=now,
    )


def refusal(limit: LimitReached) -> RateLimited:
    """429 with Retry-After and the RateLimit-* headers that say when to come back."""
    headers = {
        "RateLimit-Limit": f"{limit.limit:g}",
        "RateLimit-Remaining": "0",
        "RateLimit-Reset": str(max(1, round(limit.retry_after))),
    }
    if limit.kind == "usd_per_day":
        return BudgetExceeded(
            f"this token's daily budget of ${limit.limit:g} is used up (counting the worst "
            "case of its running runs and of this one)",
            retry_after=limit.retry_after,
            headers=headers,
        )
    what = {
        "concurrency": f"{limit.limit:g} runs at once",
        "runs_per_day": f"{limit.limit:g} runs a day",
    }[limit.kind]
    return RateLimited(f"limit reached: {what}", retry_after=limit.retry_after, headers=headers)
