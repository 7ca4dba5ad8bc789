"""Closed-loop HTTP load with Debian's ``wrk`` and a Lua script that POSTs a run body.

Every request is a new run (no Idempotency-Key). The Lua ``done`` hook prints one JSON
line with the counts and latency percentiles, so nothing is parsed from wrk's prose.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil

SCRIPT = """
wrk.method = "POST"
wrk.body = [==[%(body)s]==]
wrk.headers["Content-Type"] = "application/json"
%(auth)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nBENCH {"requests": %%d, "duration_us": %%d, "status_errors": %%d, ' ..
    '"socket_errors": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True)
class LoadResult:
    """One wrk run: throughput and latency (ms), and every failed request counted."""

    concurrency: int
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_ms: float = float("nan")
    """CPU time the server process spent per request (user + system), when measured."""

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise RuntimeError(
            "wrk is not installed: `apt-get install wrk` (scripts/system-deps.sh bench does it)"
        )
    return path


def run_wrk(
    url: str,
    body: Mapping[str, object],
    *,
    token: str | None,
    concurrency: int,
    seconds: float,
    server_pid: int | None = None,
    wrk_cpus: Collection[int] | None = None,
) -> LoadResult:
    """``wrk -t1 -c<concurrency>`` for ``seconds`` against ``url``; one thread is enough for
    a single-process server and leaves the other core to it. ``wrk_cpus``: wrk runs only on
    these CPUs (bench/rounds.py pins the server to the others)."""
    auth = f'wrk.headers["Authorization"] = "Bearer {token}"' if token else ""
    script = SCRIPT % {"body": json.dumps(body), "auth": auth}
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as folder:
        path = Path(folder) / "post.lua"
        path.write_text(script)
        argv = [wrk_path(), "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s"]
        argv += ["--timeout", "30s", "-s", str(path), url]
        server = psutil.Process(server_pid) if server_pid is not None else None
        cpu_before = _cpu_seconds(server)
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            preexec_fn=None if wrk_cpus is None else partial(os.sched_setaffinity, 0, wrk_cpus),
        )
        cpu_used = _cpu_seconds(server) - cpu_before
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if result.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({result.returncode}): {result.stderr or result.stdout}")
    data = json.loads(line.removeprefix("BENCH "))
    return LoadResult(
        concurrency=concurrency,
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=data["status_errors"] + data["socket_errors"],
        p50_ms=data["p50_us"] / 1000,
        p90_ms=data["p90_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        max_ms=data["max_us"] / 1000,
        server_cpu_ms=cpu_used * 1000 / data["requests"] if data["requests"] else float("nan"),
    )


def _cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return float("nan")
    times = process.cpu_times()
    return float(times.user + times.system)
