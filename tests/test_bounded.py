"""Bounded under load (issue 19): a listing's memory follows its ``limit``, slow and idle
clients are dropped while ``/healthz`` answers, and event streams per token are capped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from relay.store import Store
from tests.relay_server import RelayProcess
from tests.rows import run_row

OUTPUT = "x" * (1 << 20)


def _kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` figure (VmRSS, VmHWM) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


async def _write_runs(url: str, count: int) -> None:
    store = await Store.open(url)
    try:
        for number in range(count):
            row = run_row(f"run_big{number:03}", state="succeeded", stdout=OUTPUT, stderr=OUTPUT)
            await store.admit_run(row)
    finally:
        await store.close()


@pytest.fixture
def big_runs(tmp_path: Path) -> Iterator[RelayProcess]:
    relay = RelayProcess(tmp_path, max_output_bytes=1 << 20)
    relay.add_token("ops", command=True)
    asyncio.run(_write_runs(relay.env["RELAY_DATABASE_URL"], 40))
    relay.start()
    yield relay
    relay.stop()


def test_a_listing_reads_no_output_and_its_memory_follows_the_limit(
    big_runs: RelayProcess,
) -> None:
    token = big_runs.tokens["ops"]
    assert big_runs.process is not None
    pid = big_runs.process.pid
    assert big_runs.get(token, "/v1/runs", limit=1).status_code == 200  # warm
    before = _kib(pid, "VmRSS")
    listing = big_runs.get(token, "/v1/runs", limit=200)
    grown_mib = (_kib(pid, "VmHWM") - before) / 1024
    # 80 MiB of output stored: on the old code the page held all of it, several times.
    assert grown_mib < 16, f"the relay grew {grown_mib:.0f} MiB for one listing"
    runs = listing.json()["runs"]
    assert listing.status_code == 200 and len(runs) == 40
    assert all("stdout" not in run and "stderr" not in run for run in runs)
    assert {(run["stdout_bytes"], run["stderr_bytes"]) for run in runs} == {(1 << 20, 1 << 20)}
    assert len(listing.content) < 40 * 2048
    one = big_runs.get(token, f"/v1/runs/{runs[0]['id']}").json()
    assert len(one["stdout"]) == 1 << 20 and len(one["stderr"]) == 1 << 20
