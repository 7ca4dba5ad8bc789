"""The benchmark harness still runs end to end (``python -m bench --smoke``); no time is asserted."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# The benchmarks themselves, shortened: still load generators and many runs.
pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing: scripts/system-deps.sh bench")
def test_smoke_run_writes_every_section_and_every_request_succeeds(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    headings = (
        "## Targets",
        "## (1) Overhead",
        "## (2) Waiting",
        "## (3) Local",
        "## Admission",
        "## Bounded under load",
    )
    for heading in headings:
        assert heading in text
    admitted = re.findall(
        r"^\| 1000 \| (none|runs_per_day|usd_per_day) \| 10 \| [\d.]+ \|", text, re.M
    )
    assert sorted(admitted) == ["none", "runs_per_day", "usd_per_day"]
    assert "- Machine: " in text and "python -m bench --smoke" in text
    row = r"^\| (baseline|floor \(SQLite\)|relay \(SQLite\)) \| (\d+) \|.*\| (\d+) \| [\d.]+ ms \|$"
    overhead = re.findall(row, text, re.M)
    servers = ("baseline", "floor (SQLite)", "relay (SQLite)")
    assert {(name, level) for name, level, _ in overhead} == {
        (name, level) for name in servers for level in ("1", "10")
    }
    assert re.search(r"the stack's floor: [\d.]+%", text)
    assert re.search(
        r"relay CPU per run ≤ 2.0x the stack's floor \(SQLite\) \| c=10: [\d.]+x", text
    )
    # and against the floor served as it was before issue 42's third pass, in the same run
    assert re.search(r"against the floor on uvicorn's defaults: [\d.]+x \|", text)
    assert all(errors == "0" for _, _, errors in overhead), overhead
    waiting = re.findall(r"^\| (relay|baseline) \| 20 \| (\d+) \| (\d+) \|", text, re.M)
    assert sorted(waiting) == [("baseline", "20", "0"), ("relay", "20", "0")]
    assert re.search(r"^\| 10 \| 3 \| [\d.]+ \| [\d.]+ \| \d+ KiB \|", text, re.M)
    assert re.search(r"^\| 500 \| 4096 B \| [\d.]+ MiB \| [\d.]+ MiB \(500 pruned\)", text, re.M)
    assert "written to" in result.stdout


def test_the_fault_promises_hold_over_a_few_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import promises

    assert promises.main(["8"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for count in ("sandboxes leaked", "finished output was lost", "healthy runs terminated"):
        assert re.search(rf"{count}: 0$", out, re.M), out


def test_the_mcp_benchmark_measures_each_way(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import mcp_calls

    assert mcp_calls.main(["6"]) == 0
    out = capsys.readouterr().out
    for way in (
        "POST /v1/runs",
        "/mcp tool call, 2025-11-25 session",
        "/mcp tool call, 2026-07-28",
    ):
        assert re.search(rf"^\| {re.escape(way)} \| 6 \| [\d.]+ \|", out, re.M), out


def test_the_extras_diagnostic_compares_the_relay_with_its_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import extras
    from relay.http.metrics import Metrics
    from relay.runs.run_task import RunTask

    assert extras.main(["--rounds", "1", "--runs", "100"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^\| (floor|relay|relay, [^|]+) \| 100 \| [\d.]+ ms \| ([\d.]+)x \|$",
        out,
        re.M,
    )
    assert [name for name, _ in rows] == [
        "floor",
        "relay",
        "relay, log level warning",
        "relay, no log lines, no metrics (a bound, not a relay)",
        "relay, no log lines, no metrics, no sandbox (a bound)",
    ], out
    assert float(rows[0][1]) == 1.0 and float(rows[1][1]) > 1.0
    # The bound's rounds switch the metrics off only while they last.
    assert "_uncounted" not in (Metrics.record_run.__name__, Metrics.observe_request.__name__)
    assert RunTask.steps.__name__ == "steps"


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing: scripts/system-deps.sh bench")
def test_a_servers_cpu_a_request_counts_the_requests_in_flight_when_wrk_stops() -> None:
    # The server serves those too, and its CPU for them is read: dividing by the answers
    # alone put up to a third more on a slow server's short round (bench/README.md).
    from bench import load, servers

    with servers.baseline() as (process, url):
        result = load.run_wrk(
            url + "/v1/runs", {}, token=None, concurrency=10, seconds=1, server_pid=process.pid
        )
    assert result.errors == 0 and result.requests > 0
    assert result.requests < result.sent <= result.requests + 11
    assert result.server_cpu_ms > 0
