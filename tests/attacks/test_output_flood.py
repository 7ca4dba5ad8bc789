"""A job printing a byte at a time: the relay keeps each running run's output for live
streams (a replay for callers who come later, a queue for each caller following who has
not read yet), and each copy must cost about what was printed, not hundreds of times it."""

from __future__ import annotations

import tracemalloc

import pytest

from relay.http.run_stream import FOLDED_PIECES, FollowerLines, LiveRuns
from relay.runs.event_bus import EventBus, RunEvent

PIECES = 100_000


def _drain(queue: FollowerLines | None) -> list[tuple[str, str]]:
    """The output lines waiting in ``queue``, as (stream, text), after its first line."""
    assert queue is not None
    lines = [line for _ in range(queue.qsize()) if (line := queue.get_nowait()) is not None]
    assert lines[0] == {"event": "state", "state": "running"}
    return [(line["stream"], line["text"]) for line in lines[1:]]


@pytest.mark.slow  # a byte at a time for seconds
def test_output_a_byte_at_a_time_is_kept_at_about_its_size() -> None:
    """Each piece was kept as its own line (a dict and a str, ~200 bytes), in the replay and
    in the queue of each caller who had stopped reading: 100 KB printed a byte at a time
    held ~20 MB for the replay (every run that printed has one) and as much per caller."""
    events = EventBus()
    live = LiveRuns(events)
    events.publish(RunEvent("run_flood", "state", state="running"))
    reader = live.follow("run_flood", running_here=True)  # follows, never reads
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(PIECES):
            stream = "stderr" if index == PIECES // 2 else "stdout"
            events.publish(RunEvent("run_flood", "output", stream=stream, data=b"x"))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 30 * PIECES, f"{held} bytes held for {PIECES} bytes of output"
    late = live.follow("run_flood", running_here=True)  # the replay
    for texts in (_drain(reader), _drain(late)):
        streams = [stream for stream, _ in texts]
        assert streams.count("stderr") == 1
        before_stderr = "".join(text for _, text in texts[: streams.index("stderr")])
        assert before_stderr == "x" * (PIECES // 2)  # in its place
        assert "".join(text for stream, text in texts if stream == "stdout") == "x" * (PIECES - 1)
    live.close()


def test_a_line_folds_at_most_its_share_of_pieces() -> None:
    """The fold's edge: FOLDED_PIECES pieces make one line in a follower's queue, the next
    piece starts another. (A later follower's queue folds the replay's lines as pieces.)"""
    events = EventBus()
    live = LiveRuns(events)
    events.publish(RunEvent("run_edge", "state", state="running"))
    reader = live.follow("run_edge", running_here=True)
    for _ in range(FOLDED_PIECES + 1):
        events.publish(RunEvent("run_edge", "output", stream="stdout", data=b"y"))
    late = live.follow("run_edge", running_here=True)
    assert [len(text) for _, text in _drain(reader)] == [FOLDED_PIECES, 1]
    assert "".join(text for _, text in _drain(late)) == "y" * (FOLDED_PIECES + 1)
    live.close()
