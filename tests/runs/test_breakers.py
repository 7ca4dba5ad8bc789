"""A provider's breaker (relay/runs/breakers.py): what opens it, what a half-open breaker lets
through (exactly one run), what closes it, and what it never counts."""

from __future__ import annotations

from pathlib import Path

from relay.runs.breakers import Breakers, BreakerState
from tests.conftest import make_settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breakers(tmp_path: Path, **values: object) -> tuple[Breakers, Clock]:
    clock = Clock()
    settings = make_settings(tmp_path, breaker_cooldown_s=30, breaker_window_s=60, **values)
    return Breakers(settings, clock), clock


def test_consecutive_failures_open_it_and_a_success_between_starts_the_count_again(
    tmp_path: Path,
) -> None:
    breakers, _ = _breakers(tmp_path, breaker_failures=3)
    for _ in range(2):
        breakers.failed("e2b", "provider_unavailable")
    breakers.passed("e2b")
    for _ in range(2):
        breakers.failed("e2b", "provider_timeout")
    assert breakers.state("e2b") is BreakerState.closed and breakers.admits("e2b")
    breakers.failed("e2b", "provider_auth")
    assert breakers.state("e2b") is BreakerState.open and not breakers.admits("e2b")
    assert breakers.of("e2b").attempts == {
        "ok": 1,
        "provider_unavailable": 2,
        "provider_timeout": 2,
        "provider_auth": 1,
    }


def test_a_failure_rate_over_the_window_opens_it_without_failures_in_a_row(
    tmp_path: Path,
) -> None:
    breakers, clock = _breakers(tmp_path, breaker_failures=3, breaker_failure_rate=0.5)
    for _ in range(3):  # failed, ok, failed, ok...: never 3 in a row, half of them failed
        breakers.failed("modal", "provider_unavailable")
        breakers.passed("modal")
        clock.now += 1
    assert breakers.state("modal") is BreakerState.closed  # 6 creates: not yet judged
    breakers.failed("modal", "provider_unavailable")  # 4 of 7 failed
    assert breakers.state("modal") is BreakerState.open
    # Outside the window the old failures no longer count.
    other, clock = _breakers(tmp_path, breaker_failures=3, breaker_failure_rate=0.5)
    for _ in range(4):
        other.failed("modal", "provider_unavailable")
        other.passed("modal")
        clock.now += 61
    assert other.state("modal") is BreakerState.closed


def test_after_the_cooldown_exactly_one_run_tries_it_and_its_verdict_decides(
    tmp_path: Path,
) -> None:
    breakers, clock = _breakers(tmp_path, breaker_failures=1)
    breakers.failed("e2b", "provider_unavailable")
    assert breakers.cooldown_left("e2b") == 30
    clock.now += 30
    assert breakers.state("e2b") is BreakerState.half_open
    assert breakers.admits("e2b")  # this run tries it...
    assert not breakers.admits("e2b")  # ...and no other meanwhile
    breakers.failed("e2b", "provider_unavailable")
    assert breakers.state("e2b") is BreakerState.open and breakers.cooldown_left("e2b") == 30
    clock.now += 30
    assert breakers.admits("e2b")
    breakers.passed("e2b")
    assert breakers.state("e2b") is BreakerState.closed and breakers.admits("e2b")
    assert breakers.of("e2b").opened == 2


def test_a_trial_that_ends_without_a_verdict_lets_the_next_run_try(tmp_path: Path) -> None:
    """A canceled run, or one whose request was at fault, says nothing of the provider."""
    breakers, clock = _breakers(tmp_path, breaker_failures=1)
    breakers.failed("e2b", "provider_unavailable")
    clock.now += 30
    assert breakers.admits("e2b")
    breakers.released("e2b")
    assert breakers.admits("e2b")


def test_its_snapshot_is_what_a_heartbeat_carries(tmp_path: Path) -> None:
    breakers, _ = _breakers(tmp_path, breaker_failures=2)
    breakers.failed("e2b", "provider_unavailable")
    assert breakers.snapshot(["local"]) == (
        '{"e2b":{"state":"closed","consecutive_failures":1},'
        '"local":{"state":"closed","consecutive_failures":0}}'
    )
