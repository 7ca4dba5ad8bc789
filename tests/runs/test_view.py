"""A run's answer as relay/runs/view.py builds it: the times in it."""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime

import pytest

from relay.runs import view


def _reference(stamp: float) -> str:
    """How the API has always written a time."""
    return (
        datetime.fromtimestamp(stamp, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


EDGES = [
    0, 0.0, 1, 1.5, -1.5, -0.0000004, -0.0000005, -1e-7, 86399.9999996, 253402300799.999,
    1796165498.077365, 1796165498.9995, 1796165498.0005, 1796165498.9999995,
    1796165498.99999949, 1796165499.0000005, 1e9 + 0.0000015, 1e9 + 0.0000025,
]  # fmt: skip


def test_a_time_is_written_as_datetime_writes_it_to_the_millisecond_at_every_rounding_edge() -> (
    None
):
    """The times of an answer are formatted once a second and their microseconds rounded by
    hand: half-way microseconds, a rounding that carries into the next second, and times
    before 1970 read as ``datetime.fromtimestamp`` reads them."""
    generator = random.Random(42)
    stamps: list[float] = list(EDGES)
    for base in (0.0, 1.7e9, 4e9, -1e8):
        for _ in range(2_000):
            second = base + generator.randint(0, 10**6)
            stamps.append(second + generator.random())
            stamps.append(second + generator.choice([0.0005, 0.9995, 0.9999995, 0.4999995]))
            stamps.append(second + generator.randint(0, 1_999_999) / 2 / 1e6)
    generator.shuffle(stamps)
    assert [view._iso(stamp) for stamp in stamps] == [_reference(stamp) for stamp in stamps]
    assert view._iso(None) is None


@pytest.mark.parametrize("stamp", [float("nan"), float("inf"), 1e20])
def test_a_time_datetime_cannot_write_fails_as_it_does(stamp: float) -> None:
    with pytest.raises((ValueError, OverflowError)) as expected:
        _reference(stamp)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        view._iso(stamp)
