"""``relay probe PROVIDER``: create a sandbox, run ``echo ok``, terminate it, and say how
long each step took, in one dated line.

It talks to the provider directly (no relay server, no token), with the same settings
and code the relay uses, so it is the first thing to run for a new provider or key. The
sandbox is tagged as a probe's (run id ``probe_…``) and ended by the probe; a running
relay's reaper leaves it alone until it is past a probe's lifetime, then ends it (if
terminating it here failed).

The store is only read, and only for the line's pool words: where ``RELAY_DATABASE_URL``
names a store that already holds pooled rows of this provider, ``relay probe``
(relay/cli/probe.py) adds ``pool_ready=N pool_claimed=N pool_idle_s=N pool_idle_usd=X``
before ``limits=`` (:attr:`ProbeResult.pool`; relay/store/pools.py reads them without
creating or migrating anything). Likewise the provider's breakers, as the live replicas'
heartbeats last wrote them (a breaker lives in each replica's memory): ``breaker=closed``,
``breaker=open``, or each state with its count of replicas (``breaker=open:1,closed:2``),
and ``breaker_failures=N`` (the most failed creates in a row) (:attr:`ProbeResult.breaker`).
A store that is missing, unreachable or older leaves the line as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from relay.errors import RelayError
from relay.providers.contract import OutputSink, Provider, SandboxSpec
from relay.settings import Settings

PROBE_PREFIX = "probe_"
"""A probe sandbox's run id starts so: the reaper leaves it to the probe until it is past a
probe's lifetime."""
PROBE_TIMEOUT_S = 30.0
"""The probe sandbox's run timeout (its provider-side lifetime adds RELAY_GRACE_S)."""


@dataclass
class ProbeResult:
    """What a probe found: timings of the steps it reached, and the first failure."""

    provider: str
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    timings_ms: dict[str, int] = field(default_factory=dict)
    sandbox_id: str | None = None
    failed_step: str | None = None
    error: str | None = None
    limits: dict[str, str | bool] | None = None
    pool: dict[str, str] = field(default_factory=dict)
    """The provider's warm pools, relay-wide, as ``key=value`` words (empty: none)."""
    breaker: dict[str, str] = field(default_factory=dict)
    """The provider's breakers on the live replicas, as ``key=value`` words (empty: none
    known)."""

    @property
    def ok(self) -> bool:
        return self.failed_step is None

    def line(self) -> str:
        """``2026-11-29T09:05:12Z probe local ok create=41ms exec=5ms terminate=3ms …``"""
        stamp = self.started_at.isoformat(timespec="seconds").replace("+00:00", "Z")
        words = [
            stamp,
            "probe",
            self.provider,
            "ok" if self.ok else f"failed at {self.failed_step}",
        ]
        words += [
            f"{step}={self.timings_ms[step]}ms"
            for step in ("create", "exec", "terminate")
            if step in self.timings_ms
        ]
        if self.sandbox_id:
            words.append(f"sandbox={self.sandbox_id}")
        words += [f"{name}={value}" for name, value in self.pool.items()]
        words += [f"{name}={value}" for name, value in self.breaker.items()]
        if (self.pool or self.breaker) and self.limits is None:
            # Key=value words are read up to a closing `limits=`: a provider that
            # reports no limits of its own says `none`, so the line still parses.
            words.append("limits=none")
        if self.limits is not None:
            words += [
                f"{name}={value}" for name, value in self.limits.items() if isinstance(value, str)
            ]
            enforced = [name for name, value in self.limits.items() if value is True]
            words.append("limits=" + (",".join(enforced) or "none"))
        return " ".join(words)


def _describe(exc: BaseException) -> str:
    """A failure, in words the relay wrote: never the provider's own message or body."""
    if isinstance(exc, RelayError):
        return f"{exc.code}: {exc.message}"
    if isinstance(exc, TimeoutError):
        return "the provider did not answer in time"
    return f"unexpected {type(exc).__name__}"


def _ms(since: float) -> int:
    return int((time.monotonic() - since) * 1000)


async def probe(name: str, provider: Provider, settings: Settings) -> ProbeResult:
    """Create, ``echo ok``, terminate; every step is timed, the first failure recorded."""
    result = ProbeResult(provider=name, limits=getattr(provider, "limits", None))
    spec = SandboxSpec(
        run_id=f"{PROBE_PREFIX}{secrets.token_hex(8)}",
        cluster=settings.cluster,
        timeout_s=PROBE_TIMEOUT_S,
        grace_s=settings.grace_s,
    )
    step = "create"
    started = time.monotonic()
    try:
        provider.check(spec)
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(settings.create_timeout_s + 5):
                sandbox = await stack.enter_async_context(provider.sandbox(spec))
            result.timings_ms["create"] = _ms(started)
            result.sandbox_id = sandbox.id
            step, started = "exec", time.monotonic()
            output = OutputSink(4096)
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                done = await sandbox.exec(
                    ["echo", "ok"],
                    stdin=None,
                    env={},
                    workdir=None,
                    timeout_s=PROBE_TIMEOUT_S,
                    output=output,
                )
            result.timings_ms["exec"] = _ms(started)
            if done.exit_code != 0 or output.text("stdout").strip() != "ok":
                result.failed_step = "exec"
                result.error = f"`echo ok` exited {done.exit_code} without printing ok"
            step, started = "terminate", time.monotonic()
        result.timings_ms["terminate"] = _ms(started)
    except Exception as exc:
        if result.failed_step is None:
            result.failed_step, result.error = step, _describe(exc)
    return result


async def run_probe(name: str, settings: Settings) -> ProbeResult:
    """Build the provider as the relay would (``load_provider``), probe it, close it."""
    from relay.providers.registry import load_provider

    provider = load_provider(name, settings)
    try:
        return await probe(name, provider, settings)
    finally:
        with contextlib.suppress(Exception):
            await provider.aclose()
