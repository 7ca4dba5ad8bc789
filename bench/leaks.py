"""The leak report: seeded fault schedules (tests/chaos.py) and what became of every sandbox.

    python -m bench.leaks [SCHEDULES]

Prints, across the schedules: sandboxes created, terminated by the run path, terminated
by the reaper, gone by themselves (the injected "vanished" fault), leaked (must be 0),
runs left open (must be 0), and the worst time from a run's deadline to its sandbox's end.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos import Report, run_many


def summarize(reports: list[Report], seconds: float) -> str:
    total = len(reports)
    crashes = sum(r.restarts for r in reports)
    lines = [
        f"schedules: {total} (seeds 0-{total - 1}), relay crashes: {crashes}",
        f"sandboxes created: {sum(r.created for r in reports)}",
        f"terminated by the run path: {sum(r.ended_by_run for r in reports)}",
        f"terminated by the reaper: {sum(r.ended_by_reaper for r in reports)}",
        f"vanished (injected): {sum(r.vanished for r in reports)}",
        f"leaked: {sum(len(r.leaked) for r in reports)}",
        f"runs left open: {sum(len(r.not_final) for r in reports)}",
        f"worst deadline-to-termination: {max(r.worst_past_deadline_s for r in reports):.3f} s",
        f"wall time: {seconds:.1f} s",
    ]
    return "\n".join(lines)


def main(schedules: int = 200) -> int:
    import logging

    logging.disable(logging.CRITICAL)  # injected faults log on purpose
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        reports = asyncio.run(run_many(range(schedules), Path(folder)))
    print(summarize(reports, time.monotonic() - began))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
