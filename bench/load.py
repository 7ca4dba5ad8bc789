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
import time
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
local threads = {}
setup = function(thread) table.insert(threads, thread) end
init = function(args) sent = 0 end
request = function() sent = sent + 1; return wrk.format() end
done = function(summary, latency, requests)
  local e = summary.errors
  local total = 0
  for _, thread in ipairs(threads) do total = total + thread:get("sent") end
  io.write(string.format(
    '\\nBENCH {"requests": %%d, "sent": %%d, "duration_us": %%d, "status_errors": %%d, ' ..
    '"socket_errors": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, total, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""
IDLE_TICK_S = 0.05
"""How often the server's CPU is read after wrk stops, until it no longer moves."""


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
    """CPU time the server process spent per request sent (user + system), when measured:
    read once the server is idle again, over every request wrk sent, answered or in flight
    when it stopped (the server serves those too)."""
    sent: int = 0
    """Requests wrk sent: the answered ones and up to one a connection in flight at the end."""

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
        cpu_used = _settled_cpu_seconds(server) - cpu_before
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
        sent=data["sent"],
        # Over every request sent: those still in flight when wrk stopped (up to one a
        # connection) were served too, and their CPU is in ``cpu_used``.
        server_cpu_ms=cpu_used * 1000 / data["sent"] if data["sent"] else float("nan"),
    )


def _settled_cpu_seconds(process: psutil.Process | None, limit_s: float = 3.0) -> float:
    """The server's CPU once the requests in flight when wrk stopped are served: read until
    it moves by less than a clock tick in :data:`IDLE_TICK_S` (at most ``limit_s``)."""
    last = _cpu_seconds(process)
    if process is None:
        return last
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(IDLE_TICK_S)
        now = _cpu_seconds(process)
        if now - last < 0.01:
            return now
        last = now
    return last


def _cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return float("nan")
    times = process.cpu_times()
    return float(times.user + times.system)
