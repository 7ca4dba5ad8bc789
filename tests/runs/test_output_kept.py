"""Output is never thrown away: a running run shows what it has printed so far, and a
canceled run keeps everything printed until the cancel (the real service, the local
provider with bubblewrap, a real SQLite file)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from relay.auth import Principal
from relay.providers.local.provider import LocalProvider
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.store.database import Store
from tests.conftest import REPO, make_settings

PRINCIPAL = Principal(name="printer", command=True)


async def test_output_so_far_while_running_and_kept_on_cancel(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, local_isolation="bwrap", max_output_bytes=1024)
    store = await Store.open(settings.database_url)
    service = RunService(
        settings, store, Catalog.load(REPO / "jobs"), {"local": LocalProvider(settings)}
    )
    try:
        script = "echo before; echo warn >&2; head -c 5000 /dev/zero | tr '\\0' x; sleep 30"
        row, _ = await service.submit(
            PRINCIPAL, RunRequest(command=["sh", "-c", script], wait=False), None
        )
        for _ in range(100):
            seen = await service.get(PRINCIPAL, row.id)
            if seen.stdout_truncated and seen.state == "running":
                break
            await asyncio.sleep(0.05)
        assert seen.state == "running"
        assert seen.stdout.startswith("before\nxxx") and len(seen.stdout) == 1024
        assert seen.stdout_truncated and seen.stderr == "warn\n"
        canceled = await service.cancel(PRINCIPAL, row.id)
        assert canceled.state == "canceled"
        stored = await store.get_run(row.id)
        assert stored is not None
        assert stored.stdout == seen.stdout and stored.stdout_truncated
        assert stored.stderr == "warn\n"
    finally:
        await service.shutdown()
        await store.close()
