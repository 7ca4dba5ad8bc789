"""An answer of known length leaves in one send; nothing else waits for a body.

Driven through uvicorn's own protocol (the relay's subclass, relay/http/connections.py) with
a transport that records each write, so each send is seen as the kernel would get it."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from uvicorn.server import ServerState

from relay.http.connections import guarded_protocol

STREAM_GATE: asyncio.Event | None = None


async def _plain(request: Request) -> Response:
    await request.body()
    return Response(b'{"ok": true}', media_type="application/json")


async def _echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


async def _streamed(request: Request) -> Response:
    async def lines() -> Any:
        assert STREAM_GATE is not None
        await STREAM_GATE.wait()
        yield b"line\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _fails_after_start(request: Request) -> Response:
    class Broken(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            raise RuntimeError("the body never comes")

    return Broken(b"four", media_type="text/plain")


APP = Starlette(
    routes=[
        Route("/plain", _plain, methods=["GET", "POST"]),
        Route("/echo", _echo, methods=["POST"]),
        Route("/streamed", _streamed),
        Route("/broken", _fails_after_start),
    ]
)


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.reset = False
        self.unsent = 0
        """Bytes the kernel would not have taken yet: what the test says."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def abort(self) -> None:
        self.closed = self.reset = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _connect() -> tuple[Any, RecordingTransport]:
    config = uvicorn.Config(APP, log_config=None, access_log=False, server_header=False)
    protocol_class = guarded_protocol(
        header_timeout_s=5, body_timeout_s=5, write_timeout_s=5, max_connections=10
    )
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_answer_of_known_length_is_written_head_and_body_in_one_send() -> None:
    protocol, transport = _connect()
    protocol.data_received(b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle()
    assert len(transport.writes) == 1
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 12" in head
    assert body == b'{"ok": true}'
    protocol.data_received(b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive: again
    await _settle()
    assert len(transport.writes) == 2 and transport.writes[1].endswith(b'{"ok": true}')
    protocol.connection_lost(None)


async def test_a_streamed_answer_s_head_is_written_before_its_body_exists() -> None:
    global STREAM_GATE
    STREAM_GATE = asyncio.Event()
    protocol, transport = _connect()
    protocol.data_received(b"GET /streamed HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle()
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    STREAM_GATE.set()
    await _settle()
    assert b"line\n" in b"".join(transport.writes[1:])
    protocol.connection_lost(None)


async def test_a_100_continue_is_written_before_the_body_is_read() -> None:
    protocol, transport = _connect()
    protocol.data_received(
        b"POST /plain HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    await _settle()
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    protocol.data_received(b"{}")
    await _settle()
    assert len(transport.writes) == 2 and transport.writes[1].endswith(b'{"ok": true}')
    protocol.connection_lost(None)


async def test_a_held_head_is_written_before_the_connection_closes() -> None:
    protocol, transport = _connect()
    protocol.data_received(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle()
    assert transport.closed
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert transport.writes[0].endswith(b"\r\n\r\n")  # the head alone: no body came
    protocol.connection_lost(None)


async def test_a_head_answer_s_head_is_written_at_once_though_it_names_a_length() -> None:
    protocol, transport = _connect()
    protocol.data_received(b"HEAD /plain HTTP/1.1\r\nHost: x\r\n\r\n")
    await _settle()
    assert not transport.closed  # kept alive: nothing but the head would ever write it
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200 OK")
    assert b"content-length: 12" in transport.writes[0]
    assert transport.writes[0].endswith(b"\r\n\r\n")
    protocol.connection_lost(None)


async def test_a_request_begun_before_the_answer_ended_keeps_its_header_deadline() -> None:
    """The keep-alive that follows an answer is for a connection with no request under way:
    one whose next request began (pipelined, its headers unfinished) stays on that
    request's header deadline, not a keep-alive counted afresh from the answer."""
    config = uvicorn.Config(
        APP, log_config=None, access_log=False, server_header=False, timeout_keep_alive=30
    )
    protocol_class = guarded_protocol(
        header_timeout_s=0.05, body_timeout_s=5, write_timeout_s=5, max_connections=10
    )
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\nGET /plain HTTP/1.1\r\nHo")
    await _settle()
    assert transport.writes and not transport.closed  # the first answered
    await asyncio.sleep(0.2)
    assert transport.closed, "the half-sent request outlived its header deadline"
    protocol.connection_lost(None)


async def test_a_big_answer_s_body_is_written_as_it_came_not_copied_to_join_its_head() -> None:
    protocol, transport = _connect()
    body = b"x" * (1 << 20)
    protocol.data_received(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    await _settle()
    assert [len(write) for write in transport.writes[1:]] == [len(body)]
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK") and transport.writes[0].endswith(
        b"\r\n\r\n"
    )
    protocol.connection_lost(None)
