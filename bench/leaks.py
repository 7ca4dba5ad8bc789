"""The leak report: seeded fault schedules (testing/chaos.py) and what became of every sandbox.

    python -m bench.leaks [SCHEDULES [FAKE_SCHEDULES]]

Prints, across the in-memory schedules: sandboxes created, terminated by the run path,
terminated by the reaper, gone by themselves (the injected "vanished" fault), leaked (must
be 0), runs left open (must be 0), and the worst time from a run's deadline to its sandbox's
end. Then, for each cloud provider whose fake is here (``testing.rigs.ON_FAKES``), a few
shorter schedules through its real SDK: sandboxes created and leaked (must be 0). Last, the
faults that leak on a provider with no lifetime of its own (``testing/sprites_faults.py``, on
the Sprites fake): a late create answer, a failing network-policy call and a relay killed
mid-run and mid-create, each with 0 sprites left after the next sweep; and the same on the
exe.dev fake (``testing/exedev_faults.py``): a create that never answers, and a relay killed
mid-run and mid-create, each with 0 VMs left.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from testing import exedev_faults, sprites_faults
from testing.chaos import Report, fake_backend, run_many, run_schedule
from testing.rigs import ON_FAKES


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


def on_fakes(schedules: int, folder: Path) -> list[Report]:
    """``schedules`` short schedules on each provider's real SDK against its fake."""
    reports: list[Report] = []
    for name in ON_FAKES:
        began = time.monotonic()
        with fake_backend(name, folder / name) as backend:
            mine = [
                asyncio.run(run_schedule(seed, folder / f"{name}{seed}", backend, steps=12))
                for seed in range(schedules)
            ]
        print(
            f"{name} (real SDK, fake): schedules: {len(mine)}, "
            f"sandboxes created: {sum(r.created for r in mine)}, "
            f"leaked: {sum(len(r.leaked) for r in mine)}, "
            f"runs left open: {sum(len(r.not_final) for r in mine)}, "
            f"wall time: {time.monotonic() - began:.1f} s"
        )
        reports += mine
    return reports


def main(schedules: int = 200, fake_schedules: int = 2) -> int:
    import logging

    logging.disable(logging.CRITICAL)  # injected faults log on purpose
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        reports = asyncio.run(run_many(range(schedules), Path(folder)))
        print(summarize(reports, time.monotonic() - began))
        reports += on_fakes(fake_schedules, Path(folder))
        reports += sprites_faults.every_fault(Path(folder))
        reports += exedev_faults.every_fault(Path(folder))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    counts = [int(arg) for arg in sys.argv[1:3]]
    sys.exit(main(*counts))
