"""The leak report: seeded fault schedules (tests/chaos.py) and what became of every sandbox.

    python -m bench.leaks [SCHEDULES]

Prints, across the schedules: sandboxes created, terminated by the run path, terminated
by the reaper, gone by themselves (the injected "vanished" fault), leaked (must be 0),
runs left open (must be 0), and the worst time from a run's deadline to its sandbox's end.
Then a line per cloud provider fake (``tests.chaos.FAKE_SETTINGS``) whose SDK is installed:
:data:`FAKE_SCHEDULES` shorter schedules through the real SDK against its fake.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos import FAKE_SETTINGS, Report, fake_backend, run_many, run_schedule

FAKE_SCHEDULES = 3


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


def summarize_fake(name: str, reports: list[Report]) -> str:
    return (
        f"{name} fake: {len(reports)} schedules, "
        f"sandboxes created {sum(r.created for r in reports)}, "
        f"leaked {sum(len(r.leaked) for r in reports)}, "
        f"runs left open {sum(len(r.not_final) for r in reports)}"
    )


async def run_fake(name: str, folder: Path) -> list[Report] | None:
    """A few schedules through ``name``'s real SDK against its fake; None without the SDK."""
    import importlib.util

    from relay.errors import ConfigError

    if importlib.util.find_spec(f"tests.fakes.{name}") is None:
        return None
    try:
        with fake_backend(name) as backend:
            return [
                await run_schedule(seed, folder / f"{name}-{seed}", backend, steps=12)
                for seed in range(FAKE_SCHEDULES)
            ]
    except (ConfigError, ImportError):
        return None


def main(schedules: int = 200) -> int:
    import logging

    logging.disable(logging.CRITICAL)  # injected faults log on purpose
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        reports = asyncio.run(run_many(range(schedules), Path(folder)))
        print(summarize(reports, time.monotonic() - began))
        ok = all(r.ok for r in reports)
        for name in FAKE_SETTINGS:
            fake_reports = asyncio.run(run_fake(name, Path(folder)))
            if fake_reports is not None:
                print(summarize_fake(name, fake_reports))
                ok = ok and all(r.ok for r in fake_reports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
