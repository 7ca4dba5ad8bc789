"""The relay's own cost per run stays within its budget against the floor (issue 42, item 3).

A feature that adds a little to every run is how the relay's CPU per run doubled in one
round of issues with nothing noticing. This runs the in-process comparison of
``python -m bench.extras --budget`` (the relay's ASGI app and the floor's, alternating in one
process, the cheapest of many short rounds: see :func:`bench.extras.ratio_to_floor`) and
fails when the relay's ratio to the floor is over ``bench/budget.toml``.
"""

from __future__ import annotations

import tomllib

import pytest
import uvloop

from bench.extras import BUDGET_ROUNDS, BUDGET_RUNS, ratio_to_floor
from tests.conftest import REPO

BUDGET = REPO / "bench" / "budget.toml"


def committed_budget() -> float:
    budget = tomllib.loads(BUDGET.read_text())
    assert budget["reason"].strip(), "a budget says why it is what it is"
    return float(budget["ratio"])


# Its rounds are CPU-bound: alone in its worker, started with the other heavy units.
@pytest.mark.xdist_group("budget")
def test_the_relays_cpu_per_run_stays_within_its_budget_against_the_floor() -> None:
    allowed = committed_budget()
    ratio, floor_ms, relay_ms = uvloop.run(ratio_to_floor(BUDGET_ROUNDS, BUDGET_RUNS))
    assert ratio <= allowed, (
        f"the relay spends {ratio:.2f}x the floor's CPU a run (relay {min(relay_ms):.3f} ms, "
        f"floor {min(floor_ms):.3f} ms, cheapest rounds); bench/budget.toml allows {allowed:.2f}x. "
        "Find what each run now does more (bench/README.md: profiling), or raise the budget "
        "in a commit that says why."
    )
