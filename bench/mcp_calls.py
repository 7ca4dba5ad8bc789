"""The cost of a run through ``/mcp`` against the same run through ``POST /v1/runs``.

    python -m bench.mcp_calls [ROUNDS] [--write]

One relay (bench/servers.py: the memory provider's zero-latency ``noop`` job, so what is
measured is the relay and the protocol, not a sandbox), one client of each kind kept open:
``POST /v1/runs`` (``wait: true``) on a kept-alive httpx connection, and the ``noop`` tool
called through the ``mcp`` SDK's own client in a 2025-11-25 session (what most connectors
speak) and in the 2026-07-28 protocol (no session). Calls go in blocks of ten, the ways
taking turns, so drift on a shared machine falls on each alike. Reported: latency seen by
the client (the SDK's own cost included, as a connector pays it) and the relay process's
CPU per call (user + system, from psutil: it barely depends on the machine's other work).
``--write`` puts the table in bench/RESULTS.md, in its own section before the fault
promises' one.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
import psutil
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bench import promises, servers

SECTION = "<!-- bench.mcp_calls: the section below is written by python -m bench.mcp_calls -->"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BLOCK = 10


@dataclass
class Way:
    """One way of running the job: its latencies (ms) and the relay's CPU (ms) it cost."""

    name: str
    call: Callable[[], Awaitable[None]]
    samples: list[float]
    cpu_ms: float = 0.0

    def p(self, fraction: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def measure(url: str, token: str, pid: int, rounds: int) -> list[Way]:
    process = psutil.Process(pid)
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as rest,
        httpx2.AsyncClient(headers=headers, timeout=60) as http_legacy,
        httpx2.AsyncClient(headers=headers, timeout=60) as http_modern,
        Client(
            streamable_http_client(url + "/mcp", http_client=http_legacy), mode="legacy"
        ) as legacy,
        Client(
            streamable_http_client(url + "/mcp", http_client=http_modern), mode="auto"
        ) as modern,
    ):

        async def post() -> None:
            answer = await rest.post("/v1/runs", json={"job": "noop"})
            if answer.status_code != 200 or answer.json()["state"] != "succeeded":
                raise RuntimeError(f"POST /v1/runs: {answer.status_code}")

        def tool(client: Client) -> Callable[[], Awaitable[None]]:
            async def call() -> None:
                result = await client.call_tool("noop", {})
                if result.is_error:
                    raise RuntimeError(f"/mcp noop: {result.content}")

            return call

        ways = [
            Way("POST /v1/runs", post, []),
            Way("/mcp tool call, 2025-11-25 session", tool(legacy), []),
            Way("/mcp tool call, 2026-07-28", tool(modern), []),
        ]
        for way in ways:  # warm-up: connections, imports, the first session's tools
            for _ in range(3):
                await way.call()
        done = 0
        while done < rounds:
            block = min(BLOCK, rounds - done)
            for way in ways:
                cpu = process.cpu_times()
                for _ in range(block):
                    started = time.perf_counter()
                    await way.call()
                    way.samples.append((time.perf_counter() - started) * 1000)
                after = process.cpu_times()
                way.cpu_ms += (after.user - cpu.user + after.system - cpu.system) * 1000
            done += block
        return ways


def table(ways: Sequence[Way]) -> str:
    base = ways[0]
    lines = [
        "| way | calls | p50 ms | p90 ms | p99 ms | p50 ratio | relay CPU per call | CPU ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_cpu = base.cpu_ms / len(base.samples)
    for way in ways:
        cpu = way.cpu_ms / len(way.samples)
        lines.append(
            f"| {way.name} | {len(way.samples)} | {way.p(0.5):.2f} | {way.p(0.9):.2f} | "
            f"{way.p(0.99):.2f} | {way.p(0.5) / base.p(0.5):.2f}x | {cpu:.2f} ms | "
            # A few calls can take less than one tick of the process's CPU clock.
            f"{f'{cpu / base_cpu:.2f}x' if base_cpu else 'n/a'} |"
        )
    return "\n".join(lines)


def write_section(results_md: Path, text: str, command: str) -> None:
    """Replace (or add) this section, just before the fault promises' (kept as it is)."""
    content = results_md.read_text() if results_md.exists() else ""
    rest = ""
    if promises.SECTION in content:
        content, tail = content.split(promises.SECTION, 1)
        rest = promises.SECTION + tail
    content = content.split(SECTION)[0].rstrip("\n")
    section = [
        SECTION,
        "",
        "## MCP (issue 23): a tool call against `POST /v1/runs`, the same job",
        "",
        f"`{command}` (bench/mcp_calls.py): the memory provider's `noop` job, sequential "
        f"calls in blocks of {BLOCK}, the ways taking turns; latency as the client sees it "
        "(the `mcp` SDK's own client included), CPU of the relay process per call.",
        "",
        text,
        "",
        "",
    ]
    results_md.write_text(content + "\n\n" + "\n".join(section) + rest)


def main(argv: Sequence[str]) -> int:
    write = "--write" in argv
    numbers = [a for a in argv if a != "--write"]
    rounds = int(numbers[0]) if numbers else 300
    began, load = time.monotonic(), os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="relay-bench-") as folder,
        servers.relay(Path(folder) / "mcp", log_level="warning") as (relay, token),
    ):
        assert relay.process is not None
        ways = asyncio.run(measure(relay.url, token, relay.process.pid, rounds))
    text = table(ways)
    after = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    text += (
        f"\n\nWall time {time.monotonic() - began:.0f} s; load average (1, 5, 15 min) before: "
        f"{', '.join(f'{value:.2f}' for value in load)}; after: {after} (2 cores: other work "
        "on the machine blurs the latencies; the CPU column is steadier)."
    )
    print(text)
    if write:
        write_section(RESULTS, text, "python -m bench.mcp_calls " + " ".join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
