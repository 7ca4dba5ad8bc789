"""The limits policy: which limits a token's new run is admitted under, and what a caller
is told of them.

The limits are decided in the database, in the transaction that inserts the run
(relay/store/limits.py), which raises :class:`~relay.store.limits.LimitReached` or returns
the token's :class:`~relay.store.limits.Standing`; the run service turns either into the
headers here, once.

Every answer to ``POST /v1/runs`` by a token with limits carries the IETF RateLimit header
fields (draft-ietf-httpapi-ratelimit-headers, the ``RateLimit-Policy`` and ``RateLimit``
structured fields), one policy per limit the token has::

    RateLimit-Policy: "concurrent";q=2;qu="concurrent-requests", "runs-day";q=100;w=86400,
                      "usd-day";q=150;qu="usd-cents";w=86400
    RateLimit: "concurrent";r=1, "runs-day";r=99;t=3600, "usd-day";r=140;t=3600

Quotas and remainders are integers, as the fields require: a USD budget is counted in
cents (``qu="usd-cents"``; ``usd_per_day = 1.5`` is ``q=150``; fractions of a cent, in the
quota or what is left, are rounded down).
``t`` is the seconds until the policy's quota is back: midnight UTC for the daily ones; for
runs at once, given only when none is left, the expected end of the soonest running run.
A 429 adds ``Retry-After``, the ``t`` of the limit that refused.

**Fair share.** A token with no ``max_concurrent`` of its own may hold at most
``RELAY_TOKEN_SHARE`` (half) of ``RELAY_MAX_CONCURRENT``, rounded down, at least one. The
relay has no queue: a run that finds no slot is refused at once, and a slot is never taken
back from a running job. So the only way to keep room for a second tenant is to leave it
free beforehand: with half, one busy token leaves the other half to everyone else, and a
token that arrives while another fills its share still starts. A lone token gets half the
relay, not all of it: a relay serving one tenant sets ``RELAY_TOKEN_SHARE=1`` or gives the
token its own ``max_concurrent``, which wins over the share (up to the relay's limit). Many
busy tokens can still fill the relay between them: give each its own ``max_concurrent``.
Decided in the database with the other limits, so it holds across replicas; its 429 says
``Retry-After`` the soonest of the token's runs is expected to end.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from types import MappingProxyType

from relay.auth import Principal
from relay.errors import BudgetExceeded, RateLimited
from relay.settings import Settings
from relay.store.limits import Admission, LimitReached, Standing, day_start
from relay.store.records import maker

DAY_S = 86_400


def admission_for(
    principal: Principal,
    settings: Settings,
    now: float,
    settled: Mapping[str, float] | None = None,
    route: tuple[str, ...] = (),
    caps: Mapping[str, int] | None = None,
) -> Admission:
    """The limits a run of ``principal`` submitted at ``now`` is admitted under;
    ``settled``, the runs this replica knows ended (their cost) while the store still
    counts them running (their final write has not landed: relay/runs/final_writes.py);
    ``route`` (its providers in the order tried) weighs the per-provider ``caps``, if any
    has one."""
    return _make_admission(
        token_concurrent=principal.max_concurrent,
        global_concurrent=settings.max_concurrent,
        runs_per_day=principal.runs_per_day,
        usd_per_day=principal.usd_per_day,
        now=now,
        token_share=_share(settings.max_concurrent, settings.token_share),
        settled=dict(settled) if settled else _NONE_SETTLED,
        caps=tuple((name, caps.get(name)) for name in route)
        if caps and any(name in caps for name in route)
        else (),
    )


_make_admission = maker(Admission)
"""Every run's admission, made without the frozen ``__init__`` (``admission_for`` with the
fair share worked out once: 2.05 against 1.35 us)."""


_NONE_SETTLED: Mapping[str, float] = MappingProxyType({})
"""What most admissions carry as ``settled`` (the store answered every final write): one
read-only mapping shared, not an empty dict made for every run."""


def fair_share(settings: Settings) -> int | None:
    """Runs at once a token without its own ``max_concurrent`` may hold (``None``: all)."""
    return _share(settings.max_concurrent, settings.token_share)


@functools.lru_cache(maxsize=16)
def _share(max_concurrent: int, token_share: float) -> int | None:
    # Worked out once for the settings' two numbers, not for every run's admission.
    share = max(1, math.floor(max_concurrent * token_share))
    return share if share < max_concurrent else None


def cents(usd: float) -> int:
    """Whole cents of an amount, rounded down (a limit of 1.5 is exactly 150, not 149.99…;
    one finer than a cent, such as 0.025, is told as 2)."""
    return max(0, math.floor(round(usd * 100, 6)))


def rate_limit_headers(
    admission: Admission, standing: Standing, reserved_usd: float, admitted: bool
) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit`` for a token's limits, after the run was
    admitted (it counts) or refused (it does not); empty for a token with no limits."""
    if (
        admission.token_concurrent is None
        and admission.runs_per_day is None
        and admission.usd_per_day is None
    ):
        return {}  # a token with no limits of its own (most of them): no fields to tell
    taken = 1 if admitted else 0
    until_midnight = max(1, math.ceil(day_start(admission.now) + DAY_S - admission.now))
    policies: list[str] = []
    states: list[str] = []
    if admission.token_concurrent is not None and standing.active is not None:
        left = max(0, admission.token_concurrent - standing.active - taken)
        policies.append(f'"concurrent";q={admission.token_concurrent};qu="concurrent-requests"')
        frees = f";t={max(1, math.ceil(standing.frees_in))}" if standing.frees_in else ""
        states.append(f'"concurrent";r={left}' + (frees if left == 0 else ""))
    if admission.runs_per_day is not None and standing.runs_today is not None:
        left = max(0, admission.runs_per_day - standing.runs_today - taken)
        policies.append(f'"runs-day";q={admission.runs_per_day};w={DAY_S}')
        states.append(f'"runs-day";r={left};t={until_midnight}')
    if admission.usd_per_day is not None and standing.usd_today is not None:
        spent = standing.usd_today + (reserved_usd if admitted else 0.0)
        left = cents(admission.usd_per_day - spent)
        policies.append(f'"usd-day";q={cents(admission.usd_per_day)};qu="usd-cents";w={DAY_S}')
        states.append(f'"usd-day";r={left};t={until_midnight}')
    if not policies:
        return {}
    return {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(states)}


def refusal(limit: LimitReached, admission: Admission, reserved_usd: float) -> RateLimited:
    """429 with ``Retry-After`` (when the refusing limit frees) and the RateLimit fields."""
    headers = rate_limit_headers(admission, limit.standing, reserved_usd, admitted=False)
    retry_after = math.ceil(limit.retry_after)  # whole seconds, as ``t`` says
    if limit.kind == "usd_per_day":
        return BudgetExceeded(
            f"this token's daily budget of ${limit.limit:g} is used up (counting the worst "
            "case of its running runs and of this one)",
            retry_after=retry_after,
            headers=headers,
        )
    if limit.kind == "provider_concurrency":
        full = ", ".join(f"{name} ({cap} at once)" for name, cap in limit.full)
        return RateLimited(
            f"limit reached: every provider of this run's route is at its cap of runs at "
            f"once: {full}",
            retry_after=retry_after,
            headers=headers,
        )
    what = {
        "concurrency": f"{limit.limit:g} runs at once",
        "fair_share": f"{limit.limit:g} runs at once, this token's share of the relay's "
        f"{admission.global_concurrent}",
        "runs_per_day": f"{limit.limit:g} runs a day",
    }[limit.kind]
    return RateLimited(f"limit reached: {what}", retry_after=retry_after, headers=headers)
