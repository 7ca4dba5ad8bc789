"""Issue 40: what collecting a run's artifacts adds to it, on ``local`` and on a fake cloud.

``python -m bench.artifacts [--rounds N] [--write]``: the same job (writing ten 1 MiB files)
run ``--rounds`` times without artifacts and as many with ``artifacts = ["out/*"]``, one at a
time, through the real service and store (a SQLite file), on the local provider
(bubblewrap) and on E2B through its protocol fake (served by a subprocess, so its CPU is not
the relay's). It prints, per provider, the median wall time of a run each way and the
relay's CPU per run (this process's user + system time: the event loop and the store's
threads, not the sandbox's processes), and the difference: what collecting 10 MiB costs.
Then the serving side: a relay process (``python -m relay serve``, local provider) keeps one
16 MiB artifact, and ``--downloads`` (50) clients fetch it at once; its resident memory is
sampled every 5 ms (psutil) before and during, and the peak growth per download is set
against one store chunk (256 KiB): streamed, not buffered, it stays within two chunks.
``--write`` adds both tables to bench/RESULTS.md's artifacts section.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from relay.auth import Principal
from relay.providers.contract import Provider
from relay.providers.e2b import E2BProvider
from relay.providers.local.provider import LocalProvider
from relay.runs.catalog import Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunService
from relay.settings import Settings
from relay.store.database import Store

REPO = Path(__file__).resolve().parents[1]
PRINCIPAL = Principal(name="bench", command=True)
WRITE_TEN = (
    "mkdir -p out && for i in 0 1 2 3 4 5 6 7 8 9; do "
    "head -c 1048576 /dev/urandom > out/f$i.bin; done"
)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _fake_e2b() -> Iterator[str]:
    """The E2B fake in a subprocess; its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "testing.fakes.e2b"], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert process.stdout is not None
        found = re.search(r"at (http://\S+)", process.stdout.readline())
        if found is None:
            raise RuntimeError("the E2B fake did not start")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(10)


@contextlib.asynccontextmanager
async def _service(folder: Path, name: str, url: str | None) -> AsyncIterator[RunService]:
    values: dict[str, Any] = {
        "tokens_file": folder / "tokens.toml",
        "jobs_dir": REPO / "jobs",
        "database_url": f"sqlite:///{folder / (name + '.db')}",
        "local_root": folder / "sandboxes",
        "cluster": "bench",
        "providers": [name],
        "local_isolation": "bwrap",
    }
    if url is not None:
        values |= {"e2b_api_key": "bench-key", "e2b_api_url": url, "e2b_sandbox_url": url}
    settings = Settings(_env_file=None, **values)  # type: ignore[arg-type]
    store = await Store.open(settings.database_url)
    provider: Provider = LocalProvider(settings) if name == "local" else E2BProvider(settings)
    service = RunService(settings, store, Catalog.load(settings.jobs_dir), {name: provider})
    try:
        yield service
    finally:
        await service.shutdown()
        await store.close()


async def _round(service: RunService, artifacts: list[str]) -> tuple[float, float, int]:
    """One run: its wall seconds, the relay's CPU seconds, the bytes it kept."""
    request = RunRequest(command=["sh", "-c", WRITE_TEN], artifacts=artifacts)
    cpu, started = _cpu_s(), time.perf_counter()
    row, _ = await service.submit(PRINCIPAL, request, None)
    await service.wait(row.id, 120)
    wall = time.perf_counter() - started
    used = _cpu_s() - cpu
    run = await service.get(PRINCIPAL, row.id)
    if run.state != "succeeded":
        raise RuntimeError(f"a bench run ended {run.state}: {run.error_message}")
    kept = sum(1 for _ in re.finditer(r'"sha256":"[0-9a-f]', run.artifacts or ""))
    return wall, used, kept


async def measure(name: str, url: str | None, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-artifacts-") as folder:
        async with _service(Path(folder), name, url) as service:
            await _round(service, [])  # warm: the first sandbox, imports, the store
            figures: dict[str, list[tuple[float, float, int]]] = {"without": [], "with": []}
            for _ in range(rounds):  # interleaved: load on the machine hits both alike
                figures["without"].append(await _round(service, []))
                figures["with"].append(await _round(service, ["out/*"]))
    kept = {entry[2] for entry in figures["with"]}
    if kept != {10}:
        raise RuntimeError(f"expected ten artifacts kept per run, saw {kept}")
    result = {}
    for way, entries in figures.items():
        result[f"{way}_ms"] = statistics.median(e[0] for e in entries) * 1000
        result[f"{way}_cpu_ms"] = statistics.median(e[1] for e in entries) * 1000
    return result


async def _downloads(count: int) -> dict[str, float]:
    """Peak RSS growth of a relay serving one 16 MiB artifact to ``count`` clients at once."""
    import httpx
    import psutil

    from relay.store.artifacts import CHUNK_BYTES
    from testing.relay_server import RelayProcess

    with tempfile.TemporaryDirectory(prefix="bench-downloads-") as folder:
        relay = RelayProcess(Path(folder), local_isolation="bwrap")
        token = relay.add_token("bench", command=True)
        relay.start()
        try:
            script = "mkdir -p out && head -c 16777216 /dev/urandom > out/big.bin"
            body = {"command": ["sh", "-c", script], "artifacts": ["out/big.bin"]}
            run = relay.post(token, body).json()
            (entry,) = run["artifacts"]
            assert relay.process is not None
            process = psutil.Process(relay.process.pid)
            headers = relay.headers(token)
            async with httpx.AsyncClient(base_url=relay.url, timeout=120) as client:
                await client.get(entry["url"], headers=headers)  # warm: imports, buffers
                before = process.memory_info().rss
                peak = before
                done = asyncio.Event()

                async def sample() -> None:
                    nonlocal peak
                    while not done.is_set():
                        peak = max(peak, process.memory_info().rss)
                        await asyncio.sleep(0.005)

                async def fetch() -> int:
                    size = 0
                    async with client.stream("GET", entry["url"], headers=headers) as got:
                        async for chunk in got.aiter_bytes():
                            size += len(chunk)
                    return size

                sampler = asyncio.create_task(sample())
                started = time.perf_counter()
                sizes = await asyncio.gather(*(fetch() for _ in range(count)))
                took = time.perf_counter() - started
                done.set()
                await sampler
        finally:
            relay.stop()
    if set(sizes) != {16 * 1_048_576}:
        raise RuntimeError(f"a download was short: {sorted(set(sizes))}")
    growth = max(0, peak - before)
    return {
        "downloads": count,
        "before_mib": before / 1_048_576,
        "peak_mib": peak / 1_048_576,
        "growth_per_download_kib": growth / count / 1024,
        "chunk_kib": CHUNK_BYTES / 1024,
        "seconds": took,
    }


def downloads_table(result: dict[str, float]) -> str:
    per, chunk = result["growth_per_download_kib"], result["chunk_kib"]
    verdict = "within" if per <= 2 * chunk else "OVER"
    return (
        f"\nServing one 16 MiB artifact to {result['downloads']:.0f} concurrent downloads "
        f"(all in {result['seconds']:.1f} s): the relay's RSS {result['before_mib']:.0f} MiB "
        f"before, {result['peak_mib']:.0f} MiB at its peak: {per:.0f} KiB more per download, "
        f"{verdict} the target of two {chunk:.0f} KiB chunks ({2 * chunk:.0f} KiB).\n"
    )


def table(results: dict[str, dict[str, float]], rounds: int) -> str:
    lines = [
        f"Ten 1 MiB artifacts per run, median of {rounds} runs each way, one at a time "
        "(`python -m bench.artifacts`):",
        "",
        "| provider | run without | run with | added | relay CPU without | with | added |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['without_ms']:.0f} ms | {r['with_ms']:.0f} ms | "
            f"{r['with_ms'] - r['without_ms']:.0f} ms | {r['without_cpu_ms']:.0f} ms | "
            f"{r['with_cpu_ms']:.0f} ms | {r['with_cpu_ms'] - r['without_cpu_ms']:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--downloads", type=int, default=50)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    os.nice(5)
    results = {"local": asyncio.run(measure("local", None, args.rounds))}
    with _fake_e2b() as url:
        results["e2b (fake)"] = asyncio.run(measure("e2b", url, args.rounds))
    text = table(results, args.rounds) + downloads_table(asyncio.run(_downloads(args.downloads)))
    print(text)
    if args.write:
        path = REPO / "bench" / "RESULTS.md"
        heading = "## Artifacts (issue 40)\n\n"
        current = path.read_text()
        if heading in current:
            before, _, after = current.partition(heading)
            rest = after.split("\n## ", 1)
            current = before + ("\n## " + rest[1] if len(rest) > 1 else "")
        path.write_text(current.rstrip("\n") + "\n\n" + heading + text)


if __name__ == "__main__":
    main()
