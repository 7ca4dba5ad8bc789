"""The connection cap and the write deadline (relay/http/connections.py, the leftovers of
issue 42's attack), driven through the relay's uvicorn protocol with a transport that
records what it is given and says how much of it the kernel has not taken
(tests/http/test_one_send.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from relay.http.connections import guarded_protocol
from tests.http.test_one_send import APP, RecordingTransport

GET = b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n"

Connect = Callable[..., tuple[Any, RecordingTransport]]


def _server(*, max_connections: int = 10, write_timeout_s: float = 30.0) -> Connect:
    """A server's protocol class and state: each call opens one connection to it."""
    config = uvicorn.Config(
        APP, log_config=None, access_log=False, server_header=False, timeout_keep_alive=30
    )
    protocol_class = guarded_protocol(
        header_timeout_s=30,
        body_timeout_s=30,
        write_timeout_s=write_timeout_s,
        max_connections=max_connections,
    )
    state = ServerState()

    def connect(transport: RecordingTransport | None = None) -> tuple[Any, RecordingTransport]:
        protocol = protocol_class(config=config, server_state=state, app_state={})
        transport = transport or RecordingTransport()
        protocol.connection_made(transport)
        return protocol, transport

    return connect


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def _answered(transport: RecordingTransport) -> bool:
    return b"".join(transport.writes).endswith(b'{"ok": true}')


async def test_a_new_connection_past_the_cap_closes_the_oldest_idle_kept_alive_one() -> None:
    """Idle kept-alive connections filling the cap used to lock every new caller out: only
    a connection still sending its headers was closed to make room."""
    connect = _server(max_connections=3)
    idle = [connect() for _ in range(3)]
    for protocol, _ in idle:
        protocol.data_received(GET)
    await _settle()
    assert all(_answered(transport) and not transport.closed for _, transport in idle)
    fresh, fresh_transport = connect()
    assert not fresh_transport.closed, "a new caller was shut out by idle connections"
    assert [transport.closed for _, transport in idle] == [True, False, False]
    fresh.data_received(GET)
    await _settle()
    assert _answered(fresh_transport)
    for protocol, _ in [*idle, (fresh, fresh_transport)]:
        protocol.connection_lost(None)


async def test_the_cap_closes_the_longest_unoccupied_first_whether_idle_or_sending_headers() -> (
    None
):
    connect = _server(max_connections=3)
    first, first_transport = connect()
    first.data_received(GET)  # answered: idle from then on
    await _settle()
    trickling, trickling_transport = connect()
    trickling.data_received(b"GET /plain HTTP/1.1\r\nHo")  # its headers never end
    last, last_transport = connect()
    last.data_received(GET)
    await _settle()
    opened = [connect(), connect()]
    assert [first_transport.closed, trickling_transport.closed, last_transport.closed] == [
        True,
        True,
        False,
    ]
    assert not any(transport.closed for _, transport in opened)
    for protocol in (first, trickling, last, *(protocol for protocol, _ in opened)):
        protocol.connection_lost(None)


async def test_a_request_in_flight_or_an_answer_still_leaving_is_never_closed_for_room() -> None:
    connect = _server(max_connections=2)
    busy, busy_transport = connect()
    busy.data_received(b"POST /plain HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{")
    leaving, leaving_transport = connect()
    leaving_transport.unsent = 4096  # the kernel has not taken the answer's end yet
    leaving.data_received(GET)
    await _settle()
    assert _answered(leaving_transport)
    late, late_transport = connect()
    assert late_transport.closed, "no room: the new connection is the one closed"
    assert not busy_transport.closed and not leaving_transport.closed
    for protocol in (busy, leaving, late):
        protocol.connection_lost(None)
    await _settle()  # the handler waiting for the body sees the caller gone


async def test_an_answer_the_caller_stops_taking_is_dropped_at_the_write_deadline() -> None:
    connect = _server(write_timeout_s=0.2)
    protocol, transport = connect()
    transport.unsent = 1 << 20  # the kernel's buffer is full: the caller reads nothing
    protocol.data_received(GET)
    await _settle()
    assert _answered(transport) and not transport.closed
    await asyncio.sleep(0.2 * 1.25 + 0.15)
    assert transport.reset, "the answer's bytes are held for a caller that stopped reading"
    protocol.connection_lost(None)


async def test_a_caller_that_keeps_taking_a_slow_answer_is_never_cut() -> None:
    """A deadline on progress: some bytes leave every write timeout, so an answer that takes
    many timeouts in all is not cut."""
    connect = _server(write_timeout_s=0.3)
    protocol, transport = connect()
    transport.unsent = 40_000
    protocol.data_received(GET)
    await _settle()
    protocol.pause_writing()
    while transport.unsent:  # 1 s in all: more than three write timeouts
        await asyncio.sleep(0.05)
        transport.unsent -= 2000
        assert not transport.closed, "a caller still reading was cut"
    await asyncio.sleep(0.3)
    assert not transport.closed
    protocol.connection_lost(None)


async def test_an_answer_that_fails_midway_is_dropped_at_the_write_deadline_too() -> None:
    """uvicorn closes a connection itself when a handler fails after its answer's head (or
    returns without its end, or a later request is malformed): that close waits for the
    caller to take what is left, and nothing watched it, so a caller that stopped reading
    held the connection, and a place under the cap no new caller could take, for ever."""
    connect = _server(write_timeout_s=0.2)
    protocol, transport = connect()
    transport.unsent = 4096  # the kernel's buffer is full: the caller reads nothing
    protocol.data_received(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle()
    assert transport.closed, "uvicorn closes the connection of an answer that failed"
    await asyncio.sleep(0.2 * 1.25 + 0.15)
    assert transport.reset, "the failed answer's bytes are held for a caller that left"
    protocol.connection_lost(None)


async def test_a_caller_still_sending_the_body_of_a_request_answered_early_is_cut_for_room_last() -> (
    None
):
    """An answer given before the body is in (a 401, a 413, a 404) completes the request,
    but its caller is still sending the body: closing that connection for room cuts it in
    the middle of its request (a reset, its answer maybe lost), so an idle one goes first;
    with none, it goes rather than the new caller (no token needed to hold it so)."""
    connect = _server(max_connections=2)
    uploading, uploading_transport = connect()
    uploading.data_received(
        b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100
    )
    await _settle()
    assert b"".join(uploading_transport.writes).startswith(b"HTTP/1.1 404")
    idle, idle_transport = connect()
    idle.data_received(GET)
    await _settle()
    fresh, fresh_transport = connect()
    assert idle_transport.closed, "the idle kept-alive connection is the one to close"
    assert not uploading_transport.closed, "cut in the middle of sending its request"
    assert not fresh_transport.closed
    idle.connection_lost(None)
    fresh.data_received(GET)
    await _settle()
    late, late_transport = connect()
    assert fresh_transport.closed, "the idle one goes first, though it became so later"
    assert not uploading_transport.closed and not late_transport.closed
    fresh.connection_lost(None)
    late.data_received(b"POST /plain HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{")
    last, last_transport = connect()  # the only other connection has a request in flight
    assert uploading_transport.closed, "with no other, the uploading one makes room"
    assert not last_transport.closed
    for protocol in (uploading, late, last):
        protocol.connection_lost(None)


async def test_an_early_answered_upload_whose_body_ends_goes_before_one_still_uploading() -> None:
    """Once its body is in, a connection answered early is idle like any other: closed for
    room before one whose caller is still sending a body."""
    connect = _server(max_connections=2)
    head = b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    older, older_transport = connect()
    older.data_received(head + b"x")
    newer, newer_transport = connect()
    newer.data_received(head + b"x")
    await _settle()
    newer.data_received(b"x" * 999)  # its body is in: idle now
    await _settle()
    fresh, fresh_transport = connect()
    assert newer_transport.closed, "the idle one goes first"
    assert not older_transport.closed, "cut in the middle of sending its request"
    assert not fresh_transport.closed
    for protocol in (older, newer, fresh):
        protocol.connection_lost(None)


async def test_making_room_looks_at_a_few_connections_not_the_caps_worth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connections whose answers' bytes still wait were listed for closing and passed over
    by every new connection, each looking at all of them: a cap's worth of callers not
    reading made each new connection cost the relay ~0.45 ms instead of ~0.02 ms."""
    connect = _server(max_connections=200)
    held = []
    for _ in range(200):
        protocol, transport = connect()
        transport.unsent = 4096  # the kernel's buffer is full: the answer's end waits
        protocol.data_received(GET)
        held.append(protocol)
    await _settle()
    looks = 0
    protocol_class = type(held[0])
    unoccupied = protocol_class._unoccupied

    def counted(self: Any) -> bool:
        nonlocal looks
        looks += 1
        return bool(unoccupied(self))

    monkeypatch.setattr(protocol_class, "_unoccupied", counted)
    fresh, fresh_transport = connect()
    assert fresh_transport.closed, "no room: every connection's answer is still leaving"
    assert looks <= 2, f"{looks} connections looked at to make room for one"
    for protocol in [*held, fresh]:
        protocol.connection_lost(None)


class ReadingTransport(RecordingTransport):
    """A caller that keeps reading: the kernel holds a little less of the answer each time
    anyone asks, so every look of the write deadline sees bytes taken since the last one,
    however late the event loop gets to it."""

    def get_write_buffer_size(self) -> int:
        self.unsent = max(self.unsent - 100, 1)
        return self.unsent


class CountingTransport(RecordingTransport):
    """A caller that reads nothing, counting how often the write deadline looks at it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def get_write_buffer_size(self) -> int:
        self.asked += 1
        return self.unsent


async def test_a_caller_not_reading_makes_room_before_the_cap_refuses_a_new_one() -> None:
    """With nothing idle left, a connection whose caller took none of its answer since the
    write deadline last looked is reset for room (its deadline would reset it anyway); one
    whose caller keeps reading is not."""
    # Looks every 0.5 s, resets at 2 s: the test waits for the first look, not a time, and
    # a late event loop (a loaded machine) has 1.5 s before the deadline itself resets.
    connect = _server(max_connections=2, write_timeout_s=2.0)
    reading, reading_transport = connect(ReadingTransport())
    stopped_transport = CountingTransport()
    stopped, _ = connect(stopped_transport)
    for protocol, transport in ((reading, reading_transport), (stopped, stopped_transport)):
        transport.unsent = 40_000
        protocol.data_received(GET)
        await _settle()
        protocol.pause_writing()
    asked = stopped_transport.asked
    async with asyncio.timeout(10):
        while stopped_transport.asked == asked:  # the write deadline's first look
            await asyncio.sleep(0.01)
    assert not stopped_transport.reset, "the write deadline itself came first: no room made"
    fresh, fresh_transport = connect()
    assert stopped_transport.reset, "a caller reading nothing kept its place under the cap"
    assert not reading_transport.closed and not fresh_transport.closed
    for protocol in (reading, stopped, fresh):
        protocol.connection_lost(None)
