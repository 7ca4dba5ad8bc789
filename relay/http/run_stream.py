"""Live output of a run: ``GET /v1/runs/{id}/events``, one JSON object per line (NDJSON).

::

    {"event": "state", "state": "running"}
    {"event": "attempt", "provider": "e2b", "error": {"code": "provider_timeout", …},
     "message": "e2b: create timed out after 10 s; trying daytona"}
    {"event": "output", "stream": "stdout", "text": "sleeping\\n"}
    {"event": "ping"}                                   (every 15 s of silence)
    {"event": "run", "run": {…the final run, as GET /v1/runs/{id}…}}

The stream starts from the beginning of the run whenever the caller connects, and
ends with the final run. On the replica that runs the job, :class:`LiveRuns` (a
subscriber of the run EventBus) keeps each running run's events — output at most
``RELAY_MAX_OUTPUT_BYTES`` per stream, as the run itself keeps — and forgets them when
the run ends. A caller connected to another replica, or to a run that has ended, gets
the state changes polled from the store and the stored output when the run ends.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from relay.errors import TooManyStreams
from relay.run_state import RunState
from relay.runs.event_bus import EventBus, RunEvent
from relay.runs.service import RunRecord, RunService
from relay.runs.view import run_model

PING_S = 15.0
POLL_S = 0.5
CHECK_S = 5.0
"""How often a stream fed by this replica's buffer, silent meanwhile, looks at the stored
run: if it ended more than :data:`END_GRACE_S` ago and no end reached the buffer, the
stream ends anyway (at most ``CHECK_S`` + ``END_GRACE_S`` past the run's end)."""
END_GRACE_S = 5.0
Line = dict[str, Any]


FOLDED_PIECES = 256
"""Output pieces of one stream kept as bare text before they become one replayed line."""


class FollowerLines(asyncio.Queue[Line | None]):
    """One caller's lines not yet sent. Output pieces of one stream that wait together
    leave as one line (up to :data:`FOLDED_PIECES` pieces): a caller who stopped reading
    held a line (~300 bytes) per piece a job printed, which could be a byte each."""

    def _init(self, maxsize: int) -> None:
        self._queue: collections.deque[Line | list[str] | None] = collections.deque()
        self._streams: collections.deque[str] = collections.deque()
        """The stream of each waiting list of pieces, in order."""

    def _put(self, item: Line | None) -> None:
        waiting = self._queue
        if item is not None and item["event"] == "output":
            last = waiting[-1] if waiting else None
            if (
                isinstance(last, list)
                and self._streams[-1] == item["stream"]
                and len(last) < FOLDED_PIECES
            ):
                last.append(item["text"])
            else:
                waiting.append([item["text"]])
                self._streams.append(item["stream"])
            return
        waiting.append(item)

    def _get(self) -> Line | None:
        item = self._queue.popleft()
        if isinstance(item, list):
            return {"event": "output", "stream": self._streams.popleft(), "text": "".join(item)}
        return item


@dataclass
class _Buffer:
    """One running run's events so far, and the queues of callers following it.

    Output is replayed in lines of up to :data:`FOLDED_PIECES` pieces: a line each (a dict
    and its text, some 300 bytes) for a job printing a byte at a time held some 300 times
    its output in the relay's memory, for every run that printed, followed or not."""

    events: list[Line] = field(default_factory=list)
    followers: list[FollowerLines] = field(default_factory=list)
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)
    pieces: list[str] = field(default_factory=list)
    """The latest output texts, all of ``pieces_stream``, not yet folded into ``events``."""
    pieces_stream: str = ""

    def add(self, line: Line) -> None:
        for queue in self.followers:
            queue.put_nowait(line)
        if line["event"] != "output":
            self._fold()
            self.events.append(line)
            return
        if line["stream"] != self.pieces_stream:
            self._fold()
            self.pieces_stream = line["stream"]
        self.pieces.append(line["text"])
        if len(self.pieces) >= FOLDED_PIECES:
            self._fold()

    def _fold(self) -> None:
        if self.pieces:
            text = "".join(self.pieces)
            self.events.append({"event": "output", "stream": self.pieces_stream, "text": text})
            self.pieces.clear()

    def replay(self) -> list[Line]:
        """The run's events so far, its output folded."""
        self._fold()
        return self.events

    def text(self, stream: str, data: bytes, final: bool = False) -> str:
        decoder = self.decoders.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        return decoder.decode(data, final)


class LiveRuns:
    """Replay buffers of the runs this replica is running, fed by the EventBus."""

    def __init__(self, events: EventBus, *, max_streams_per_token: int = 8) -> None:
        self._runs: dict[str, _Buffer] = {}
        # A run nobody follows and that has printed nothing needs no buffer: the states it
        # went through are enough to replay its events so far to a caller who comes
        # later. Most runs are never followed; this keeps them cheap.
        self._states: dict[str, tuple[str, ...]] = {}
        self._unsubscribe = events.subscribe(self._on_event)
        self.max_streams_per_token = max_streams_per_token
        self._streams: dict[str, int] = {}

    def hold_stream(self, token: str) -> Callable[[], None]:
        """Count one open stream of ``token``; raises :class:`TooManyStreams` past the
        cap. Returns the function that releases it (call it once, as the stream ends)."""
        held = self._streams.get(token, 0)
        if held >= self.max_streams_per_token:
            raise TooManyStreams(
                f"this token has {held} event streams open; close one first",
                retry_after=CHECK_S,
            )
        self._streams[token] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._streams.pop(token) - 1
                if left:
                    self._streams[token] = left

        return release

    def close(self) -> None:
        self._unsubscribe()
        for run_id in list(self._runs):
            self._end(run_id)

    def _on_event(self, event: RunEvent) -> None:
        run_id = event.run_id
        if event.kind == "finished":
            self._states.pop(run_id, None)
            self._end(run_id)
            return
        buffer = self._runs.get(run_id)
        if buffer is None:
            if event.kind == "state" and event.state is not None:
                self._states[run_id] = (*self._states.get(run_id, ()), event.state)
                return
            buffer = self._open(run_id)
        if event.kind == "state":
            buffer.add({"event": "state", "state": event.state})
        elif event.kind == "attempt" and event.attempt is not None:
            buffer.add(attempt_line(event))
        elif event.kind == "output" and event.stream:
            text = buffer.text(event.stream, event.data)
            if text:
                buffer.add({"event": "output", "stream": event.stream, "text": text})

    def _open(self, run_id: str) -> _Buffer:
        """The run's buffer, begun with the states it has been through so far."""
        buffer = self._runs[run_id] = _Buffer()
        for state in self._states.pop(run_id, ()):
            buffer.add({"event": "state", "state": state})
        return buffer

    def _end(self, run_id: str) -> None:
        buffer = self._runs.pop(run_id, None)
        if buffer is None:
            return
        for stream in list(buffer.decoders):
            tail = buffer.text(stream, b"", final=True)
            if tail:
                buffer.add({"event": "output", "stream": stream, "text": tail})
        for queue in buffer.followers:
            queue.put_nowait(None)

    def follow(self, run_id: str, *, running_here: bool) -> FollowerLines | None:
        """A queue holding the run's events so far, then each new one, then None at the
        end; None when this replica is not running the run."""
        buffer = self._runs.get(run_id)
        if buffer is None:
            if not running_here and run_id not in self._states:
                return None
            buffer = self._open(run_id)  # or no event yet: it is about to start
        queue = FollowerLines()
        for line in buffer.replay():
            queue.put_nowait(line)
        buffer.followers.append(queue)
        return queue

    def unfollow(self, run_id: str, queue: FollowerLines) -> None:
        buffer = self._runs.get(run_id)
        if buffer is not None and queue in buffer.followers:
            buffer.followers.remove(queue)


def attempt_line(event: RunEvent) -> Line:
    """A route's failed attempt as a line of the stream (``attempt``)."""
    attempt = event.attempt
    assert attempt is not None
    return {
        "event": "attempt",
        "provider": attempt.provider,
        "error": {"code": attempt.error_code, "message": attempt.error_message},
        "message": event.message,
    }


def _encode(line: Line) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


async def _final_lines(
    service: RunService, run_id: str, *, with_output: bool
) -> AsyncIterator[bytes]:
    run = await service.find(run_id)
    if run is None:  # pragma: no cover - pruned meanwhile (relay/store/retention.py)
        return
    if with_output:
        for stream, text in (("stdout", run.stdout), ("stderr", run.stderr)):
            if text:
                yield _encode({"event": "output", "stream": stream, "text": text})
    found = await service.deliveries([run])
    answer = run_model(run, found.get(run_id, [])).model_dump(mode="json")
    yield _encode({"event": "run", "run": answer})


async def _ended_long_ago(service: RunService, run_id: str) -> bool:
    """Whether the stored run is final and ended more than END_GRACE_S ago."""
    run = await service.find(run_id)
    if run is None:
        return True
    ended = run.ended_at or run.created_at
    return run.state.final and ended + END_GRACE_S <= time.time()


async def follow_run(live: LiveRuns, service: RunService, run: RunRecord) -> AsyncIterator[bytes]:
    """The NDJSON lines of one run, from its start to its final state."""
    run_id = run.id
    queue = None
    if not run.state.final:
        queue = live.follow(run_id, running_here=service.holds(run_id))
    if queue is not None:
        try:
            silent = 0.0
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), CHECK_S)
                except TimeoutError:
                    # The end may never reach this buffer (it was made as the run ended):
                    # the store says when the run is over.
                    try:
                        if await _ended_long_ago(service, run_id):
                            break
                    except Exception:
                        if not service.holds(run_id):
                            raise
                        # The store is away: this run's end still comes through this
                        # replica's buffer (or its outcome kept in memory).
                    silent += CHECK_S
                    if silent >= PING_S:
                        silent = 0.0
                        yield _encode({"event": "ping"})
                    continue
                silent = 0.0
                if line is None:
                    break
                yield _encode(line)
        finally:
            live.unfollow(run_id, queue)
        async for chunk in _final_lines(service, run_id, with_output=False):
            yield chunk
        return
    # Not running here: state changes from the store; output once the run has ended.
    state: RunState | None = None
    quiet = 0.0
    while True:
        current = await service.find(run_id)
        if current is None:  # pragma: no cover - pruned meanwhile (relay/store/retention.py)
            return
        if current.state != state:
            state = current.state
            quiet = 0.0
            if not state.final:
                yield _encode({"event": "state", "state": state.value})
        if state is not None and state.final:
            break
        await asyncio.sleep(POLL_S)
        quiet += POLL_S
        if quiet >= PING_S:
            quiet = 0.0
            yield _encode({"event": "ping"})
    async for chunk in _final_lines(service, run_id, with_output=True):
        yield chunk
