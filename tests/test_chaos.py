"""At least 200 seeded schedules of submits, cancels, faults and crashes: nothing leaks.

A failure names the seeds; replay one with ``python -m tests.chaos SEED``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.chaos import run_many

SCHEDULES = 200


async def test_no_schedule_leaks_a_sandbox_or_leaves_a_run_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL)  # injected faults log on purpose
    reports = await run_many(range(SCHEDULES), tmp_path)
    failed = [r for r in reports if not r.ok]
    assert not failed, "seeds that leaked or left runs open: " + ", ".join(
        f"{r.seed} (leaked {r.leaked}, open {r.not_final})" for r in failed
    )
    assert len(reports) == SCHEDULES
    # The schedules really exercised the paths they claim to.
    assert sum(r.restarts for r in reports) >= 20
    assert sum(r.ended_by_reaper for r in reports) >= 50
    assert sum(r.ended_by_run for r in reports) >= 200
    assert sum(r.vanished for r in reports) >= 10
