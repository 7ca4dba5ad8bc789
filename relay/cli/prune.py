"""``relay prune``: delete final runs older than RELAY_RETENTION_DAYS."""

from __future__ import annotations

import argparse
import asyncio
import time

from relay.cli.configuration import load_settings, open_store
from relay.errors import ConfigError
from relay.settings import Settings


async def _prune(settings: Settings, older_than_days: float, dry_run: bool) -> int:
    from relay.store import retention
    from relay.store.objects import open_objects

    store = await open_store(settings.database_url)
    try:
        objects = await open_objects(settings)
        before = retention.cutoff(older_than_days)
        pruned = await retention.prune(store, before, dry_run=dry_run, objects=objects)
        size = await store.read(retention.size_bytes)
    finally:
        await store.close()
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {pruned.runs} run(s) and {pruned.deliveries} delivery row(s) created before "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(before))} UTC"
    )
    if not dry_run and store.is_sqlite:
        size = retention.vacuum_if_needed(settings.database_url) or size
    print(
        f"{verb} {pruned.artifacts} artifact content(s) no run names: {pruned.artifact_bytes} bytes"
    )
    print(f"store size: {size} bytes")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    settings = load_settings()
    days = settings.retention_days if args.older_than is None else args.older_than
    if days < 1:
        raise ConfigError("--older-than: at least 1 day (today's runs count against limits)")
    return asyncio.run(_prune(settings, days, args.dry_run))
