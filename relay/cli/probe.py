"""``relay probe``: create a sandbox, run ``echo ok``, terminate it, print the timings."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.cli.configuration import load_settings
from relay.client import EXIT_UNAVAILABLE
from relay.errors import ConfigError
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.providers.probe import ProbeResult


def _remove_empty_folders(top: Path) -> None:
    """``top`` and the folders under it that hold nothing (a sandbox left behind stays)."""
    for folder, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


async def _probe(name: str, settings: Settings) -> ProbeResult:
    """The probe, and the provider's warm pools where the store already holds some: today
    (UTC) and relay-wide, like an admin token's ``/v1/usage``; and its breakers on the live
    replicas, as their heartbeats last wrote them."""
    from relay.providers.probe import run_probe
    from relay.store.limits import day_start
    from relay.store.pools import read_summary
    from relay.store.quiet_reads import read_breakers

    # The state directory follows RELAY_DATABASE_URL (a SQLite file's folder) and the
    # local provider makes its sandbox root there: where it did not exist, the probe leaves
    # none of it behind (a mistyped path, or a folder a relay of another user could not use).
    state = settings.state_directory().absolute()
    missing = next((p for p in reversed([state, *state.parents]) if not p.exists()), None)
    try:
        result = await run_probe(name, settings)
    finally:
        if missing is not None:
            _remove_empty_folders(missing)
    # Side by side: each read waits QUIET_READ_TIMEOUT_S at most for a store that does not
    # answer (a name no server resolves), and one after the other held the probe twice that.
    pools, breakers = await asyncio.gather(
        read_summary(settings.database_url, name, day_start(time.time())),
        read_breakers(settings.database_url, name),
    )
    if pools is not None:
        result.pool = {
            "pool_ready": str(pools.ready),
            "pool_claimed": str(pools.claimed),
            "pool_idle_s": str(round(pools.idle_s)),
            "pool_idle_usd": f"{pools.idle_usd:.6f}",
        }
    if breakers is not None:
        states = breakers.states
        shown = (
            next(iter(states))
            if len(states) == 1
            else ",".join(f"{state}:{count}" for state, count in sorted(states.items()))
        )
        result.breaker = {
            "breaker": shown,
            "breaker_failures": str(breakers.consecutive_failures),
        }
    return result


def cmd_probe(args: argparse.Namespace) -> int:
    from relay.providers.registry import PROVIDERS

    settings = load_settings()
    if args.provider not in PROVIDERS:  # the argument, not RELAY_PROVIDERS, is wrong
        known = ", ".join(name for name in PROVIDERS if name != "memory")
        raise ConfigError(f"no provider named {args.provider!r}; probe one of: {known}")
    result = asyncio.run(_probe(args.provider, settings))
    print(json.dumps(_as_json(result), indent=2) if args.json else result.line(), flush=True)
    if not result.ok:
        print(f"error: {result.error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


def _as_json(result: ProbeResult) -> dict[str, Any]:
    """What the line says, as JSON: ``ok``, ``started_at``, ``timings_ms``, ``limits``…"""
    found = dataclasses.asdict(result)
    found["started_at"] = result.started_at.isoformat(timespec="seconds").replace("+00:00", "Z")
    return {"ok": result.ok, **found}
