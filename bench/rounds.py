"""Overhead rounds: the targets of (1) measured in several short rounds, every level of
every target in each round, in an order that changes round to round; each round's
relay-to-floor ratio, and the figure their median.

One long point per target read the relay over its floor 1.77x and 2.64x a minute apart on a
quiet machine: whatever else the machine did during one target's seconds and not the
other's went into the ratio. In a round the relay and its floor are measured back to back,
and the order flips every round (relay, floor, floor, relay, ...) so neither is always the
one measured first or right after the other; the median of the rounds' ratios drops the
round a burst of other work fell into, where one point keeps it.

Every level is in every round (issue 42, fifth pass): measured level after level, a
server's c=10 and c=50 were read minutes apart on a machine whose speed drifts by more than
concurrency moves the CPU a run, so RESULTS.md once read the floor's CPU a run falling with
concurrency and the relay's flat, which read back to back they do not. The levels' order
rotates each round, so none is always first.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import psutil

from bench.load import LoadResult


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The targets in round ``index``: as given in even rounds, reversed in odd ones, so two
    targets next to each other swap places every round (relay, floor, floor, relay, ...)."""
    return list(names) if index % 2 == 0 else list(reversed(names))


def round_plan(names: Sequence[str], levels: Sequence[int], index: int) -> list[tuple[str, int]]:
    """What round ``index`` measures, in order: every level of every target. The levels
    rotate one place each round (the first level of one round is the last of the next), and
    at every level the targets are in :func:`round_order`, so two targets next to each other
    are back to back at each level and swap places every round."""
    shift = index % len(levels) if levels else 0
    rotated = [*levels[shift:], *levels[:shift]]
    return [(name, level) for level in rotated for name in round_order(names, index)]


def measure_rounds(
    names: Sequence[str],
    levels: Sequence[int],
    rounds: int,
    measure: Callable[[str, int], LoadResult],
    say: Callable[[str], None] = lambda _message: None,
) -> dict[str, dict[int, list[LoadResult]]]:
    """``rounds`` rounds of :func:`round_plan`, ``measure(target, level)`` for each slot;
    each target's rows at each level, in the order measured (round by round)."""
    measured: dict[str, dict[int, list[LoadResult]]] = {
        name: {level: [] for level in levels} for name in names
    }
    for index in range(rounds):
        say(f"(1) round {index + 1} of {rounds}: every level of every target")
        for name, level in round_plan(names, levels, index):
            measured[name][level].append(measure(name, level))
    return measured


def round_seconds(seconds: float, rounds: int) -> int:
    """Each round's wrk duration: ``seconds`` split into ``rounds`` (wrk counts whole
    seconds, so never under 1)."""
    return max(1, round(seconds / rounds))


def combine(rounds: Sequence[LoadResult]) -> LoadResult:
    """One row for a target's rounds at one concurrency: the requests (answered and sent),
    the time and the errors summed; the latency percentiles and the server CPU per request
    the median of the rounds' (a burst of other work in one round does not move it); the
    max the largest."""
    if not rounds:
        raise ValueError("no rounds to combine")
    return LoadResult(
        concurrency=rounds[0].concurrency,
        requests=sum(r.requests for r in rounds),
        seconds=sum(r.seconds for r in rounds),
        errors=sum(r.errors for r in rounds),
        p50_ms=statistics.median(r.p50_ms for r in rounds),
        p90_ms=statistics.median(r.p90_ms for r in rounds),
        p99_ms=statistics.median(r.p99_ms for r in rounds),
        max_ms=max(r.max_ms for r in rounds),
        server_cpu_ms=statistics.median(r.server_cpu_ms for r in rounds),
        sent=sum(r.sent for r in rounds),
    )


@dataclass(frozen=True)
class RoundRatios:
    """A target's server CPU per request over another's, round by round (paired: the two
    measured in the same round, back to back)."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    def describe(self) -> str:
        """``4 rounds, 1.98-2.11x``: how many, and the spread."""
        if len(self.ratios) == 1:
            return "1 round"
        return f"{len(self.ratios)} rounds, {self.low:.2f}-{self.high:.2f}x"


def round_ratios(target: Sequence[LoadResult], base: Sequence[LoadResult]) -> RoundRatios:
    """Each round's ``target`` CPU per request over ``base``'s in the same round."""
    if not target or len(target) != len(base):
        raise ValueError(f"rounds do not pair: {len(target)} against {len(base)}")
    return RoundRatios(
        tuple(t.server_cpu_ms / b.server_cpu_ms for t, b in zip(target, base, strict=True))
    )


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def pin(pid: int, cpus: Iterable[int]) -> None:
    """Keep every thread of process ``pid`` on ``cpus`` (threads it starts later inherit
    their creator's CPUs). Linux sets affinity per thread, so each is set."""
    wanted = set(cpus)
    for thread in psutil.Process(pid).threads():
        try:
            os.sched_setaffinity(thread.id, wanted)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


@contextlib.contextmanager
def pinned(pids: Sequence[int], *, enabled: bool) -> Iterator[list[int] | None]:
    """With ``enabled`` and 2 CPUs or more: the servers ``pids`` on the first CPU, and the
    CPUs wrk is to use (the others) yielded; every CPU given back to the servers after.
    Else None, nothing pinned. Every server gets the same CPU, so the ratios stay fair;
    wrk's own CPU then no longer competes with the server it loads."""
    cpus = usable_cpus()
    if not enabled or len(cpus) < 2:
        yield None
        return
    for pid in pids:
        pin(pid, cpus[:1])
    try:
        yield cpus[1:]
    finally:
        for pid in pids:
            pin(pid, cpus)
