"""``relay reap``: one reaper sweep from cron, for what outlived its run."""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import sys
import time
from datetime import UTC, datetime

from relay.cli.configuration import load_settings, open_store
from relay.client import EXIT_UNAVAILABLE
from relay.settings import Settings


async def _reap(settings: Settings, dry_run: bool, now: bool = False) -> int:
    from relay.providers.registry import load_providers
    from relay.runs.reaper import Reaper

    store = await open_store(settings.database_url)
    # Built to end nothing as they come up: in a dry run nothing is ended at all, and what
    # a relay's start would end (local's leftovers) is the sweep's to end and print.
    providers = load_providers(settings, for_reaper=True)
    # One sweep from cron: the store was just reached, so the replicas' beats are judged.
    # This process holds no run, so every active run it finds is another replica's.
    reaper = Reaper(
        store,
        providers,
        settings,
        holds=lambda run_id: False,
        instance_id="reap_" + secrets.token_hex(8),
        grace_s=settings.grace_s,
        single_replica=False,
        beats_before_judging=0,
    )
    try:
        report = await reaper.sweep(dry_run=dry_run, judge_now=now)
    finally:
        for provider in providers.values():
            await provider.aclose()
        await store.close()
    listed = ", ".join(f"{name} {count}" for name, count in report.listed.items())
    print(f"found {report.active_runs} active run(s); sandboxes listed: {listed or 'none'}")
    verb = "would terminate" if dry_run else "terminated"
    for provider_name, sandbox_id in report.terminated:
        print(f"{verb} {provider_name} {sandbox_id}")
    for run_id in report.lost_runs:
        print(f"{'would mark' if dry_run else 'marked'} {run_id} lost")
    for provider_name, sandbox_id in report.failures:
        print(f"failed to terminate {provider_name} {sandbox_id}", file=sys.stderr)
    for waiting in report.waiting:
        print(f"left for now: {waiting.subject}: {waiting.reason}{_until(waiting.until)}")
    if any(waiting.subject.startswith("run ") for waiting in report.waiting) and not now:
        print("if you know no relay runs on this database: relay reap --now")
    return EXIT_UNAVAILABLE if report.failures else 0


def _until(moment: float | None) -> str:
    """`` (until <UTC time>, in N s)`` for a report line; nothing for no time."""
    if moment is None:
        return ""
    at = datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f" (until {at}, in {max(0, math.ceil(moment - time.time()))} s)"


def cmd_reap(args: argparse.Namespace) -> int:
    return asyncio.run(_reap(load_settings(), args.dry_run, args.now))
