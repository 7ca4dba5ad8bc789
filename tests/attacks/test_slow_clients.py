"""Slow, silent and pipelining clients against a real relay's connections (issue 42's one
timer and one send, relay/http/connections.py): every deadline still closes its connection,
every answer still leaves when it is ready, and ``/healthz`` answers throughout; a caller
that stops reading an answer, or holds the cap's worth of idle connections, costs the relay
nothing lasting (issue 42's leftovers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from relay.store.database import Store
from testing.relay_server import RelayProcess
from testing.rows import run_row

DEADLINE_S = 1.0
"""The header, body, write and keep-alive deadlines of the relay under test."""
MAX_CONNECTIONS = 8
"""Its connection cap (the least the setting allows)."""
LATE_S = 1.5
"""How long past a deadline a close may come on a loaded machine before it is a failure."""
STEADY_READ_BYTES = 256 * 1024
"""What the steady reader below reads every quarter of a deadline (1 MiB a second)."""


BIG_RUN = "run_big000"
"""A run whose answer is ~12 MiB (1 MiB of output a stream, each byte escaped in six)."""


async def _write_big_run(url: str) -> None:
    store = await Store.open(url)
    try:
        output = "\x01" * (1 << 20)
        await store.admit_run(run_row(BIG_RUN, state="succeeded", stdout=output, stderr=output))
    finally:
        await store.close()


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    server = RelayProcess(
        tmp_path_factory.mktemp("slow-clients"),
        header_timeout_s=DEADLINE_S,
        body_timeout_s=DEADLINE_S,
        keep_alive_s=DEADLINE_S,
        write_timeout_s=DEADLINE_S,
        max_connections=MAX_CONNECTIONS,
        max_output_bytes=1 << 20,
    )
    server.add_token("ops", command=True)
    asyncio.run(_write_big_run(server.env["RELAY_DATABASE_URL"]))
    server.start()
    yield server
    server.stop()


@contextlib.contextmanager
def _connection(relay: RelayProcess) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
    try:
        yield sock
    finally:
        sock.close()


def _answer(sock: socket.socket, timeout_s: float) -> bytes:
    """One answer's head (and what came with it), read until the head ends or time is up."""
    sock.settimeout(timeout_s)
    received = b""
    with contextlib.suppress(TimeoutError):
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return received


def _closed_after(sock: socket.socket, started: float, limit_s: float) -> float:
    """Seconds from ``started`` until the relay closed ``sock`` (what it sent is dropped)."""
    sock.settimeout(0.05)
    while time.monotonic() - started < limit_s:
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - started
    raise AssertionError(f"still open after {limit_s} s")


@pytest.mark.slow  # needs a relay process: seconds
def test_a_head_request_on_a_kept_alive_connection_is_answered_at_once(
    relay: RelayProcess,
) -> None:
    """A HEAD answer names its length but has no body: its head must not wait for one (it
    did, held for the one send until the keep-alive deadline closed the connection)."""
    with _connection(relay) as sock:
        sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = _answer(sock, DEADLINE_S / 2)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"content-length:" in head.lower() and head.endswith(b"\r\n\r\n")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive: the next
        assert _answer(sock, DEADLINE_S / 2).startswith(b"HTTP/1.1 200")


@pytest.mark.slow  # needs a relay process: seconds
def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_deadline(
    relay: RelayProcess,
) -> None:
    with _connection(relay) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        with contextlib.suppress(ConnectionError):
            while time.monotonic() - started < DEADLINE_S + LATE_S:
                sock.sendall(b"a")  # a byte keeps coming: no deadline is moved by it
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    if not sock.recv(4096):
                        break
        assert time.monotonic() - started < DEADLINE_S + LATE_S
        assert relay.get(None, "/healthz").status_code == 200


@pytest.mark.slow  # needs a relay process: seconds
def test_a_kept_alive_connection_that_never_asks_again_is_closed_at_its_deadline(
    relay: RelayProcess,
) -> None:
    with _connection(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(sock, 5).startswith(b"HTTP/1.1 200")
        elapsed = _closed_after(sock, time.monotonic(), DEADLINE_S + LATE_S)
        assert elapsed > DEADLINE_S / 2, "closed before its keep-alive deadline"


@pytest.mark.slow  # needs a relay process: seconds
def test_a_kept_alive_connection_whose_next_request_stalls_is_cut_at_the_header_deadline(
    relay: RelayProcess,
) -> None:
    """The next request's first byte ends keep-alive and starts its header deadline, which a
    request whose headers never end meets; a body that never ends meets its body deadline."""
    for stall in (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", _stalled_body(relay)):
        with _connection(relay) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(sock, 5).startswith(b"HTTP/1.1 200")
            time.sleep(DEADLINE_S / 2)  # half its keep-alive gone
            started = time.monotonic()
            sock.sendall(stall)
            elapsed = _closed_after(sock, started, DEADLINE_S + LATE_S)
            assert elapsed > DEADLINE_S * 0.8, "cut by the keep-alive deadline, not its own"


def _stalled_body(relay: RelayProcess) -> bytes:
    head = f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {relay.tokens['ops']}\r\n"
    return head.encode() + b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{"


@pytest.mark.slow  # needs a relay process: seconds
def test_pipelined_requests_are_answered_in_order_each_at_once(relay: RelayProcess) -> None:
    with _connection(relay) as sock:
        sock.sendall(
            b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        sock.settimeout(DEADLINE_S / 2)
        received = b""
        with contextlib.suppress(TimeoutError):
            while received.count(b"HTTP/1.1 ") < 3:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", received)
        assert statuses == [b"200", b"200", b"404"], received


@pytest.mark.slow  # needs a relay process: seconds
def test_a_pipelined_request_read_in_part_waits_for_the_answer_before_it_without_a_deadline(
    relay: RelayProcess,
) -> None:
    """A request pipelined behind one that takes longer than the body deadline (a run
    answered when it ends), whose body came in part with the first read: the relay reads
    no more of it until the first is answered, so its deadline starts then, not while the
    relay itself does not read (the connection was closed at the body deadline, the first
    request's answer lost though its run was made)."""
    body = json.dumps({"command": ["sh", "-c", f"sleep {2 * DEADLINE_S}; echo done"]}).encode()
    head = (
        f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {relay.tokens['ops']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with _connection(relay) as sock:
        sock.sendall(head + body + head + body[:5])  # the second's body: its first bytes
        sock.settimeout(10)
        received = b""
        for answers, which in ((1, "first"), (2, "second")):
            while received.count(b'"state":"succeeded"') < answers:
                chunk = sock.recv(65536)
                assert chunk, f"closed before the {which} answer: {received!r}"
                received += chunk
            if answers == 1:
                sock.sendall(body[5:])  # the rest, once the first is answered
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"200"], received


@pytest.mark.slow  # needs a relay process: seconds
def test_a_header_block_of_megabytes_is_cut_at_the_cap_not_kept(relay: RelayProcess) -> None:
    """httptools keeps a header block whole however long: a 64 MiB header was answered 200,
    +65 MiB of the relay's memory for one connection, bounded only by the header deadline
    (a cap's worth of connections: gigabytes). Past MAX_HEADER_BYTES (and the read that began
    the request) nothing more is read: the caller's sends fail at once, and the relay's
    memory does not follow what it sent."""
    server = psutil.Process(relay.process.pid if relay.process else 0)
    before = server.memory_info().rss
    started = time.monotonic()
    refused = False
    with _connection(relay) as sock:
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(32):
                sock.sendall(b"a" * (1 << 20))
            sock.sendall(b"\r\n\r\n")
        except (ConnectionError, TimeoutError):
            refused = True
        received = b"" if refused else _answer(sock, 5)
    assert refused or received.startswith(b"HTTP/1.1 431"), received[:100]
    assert time.monotonic() - started < 4.0  # the header deadline (10 s) did not end it
    assert server.memory_info().rss - before < 16 << 20
    assert relay.get(None, "/healthz").status_code == 200


@pytest.mark.slow  # needs a relay process: seconds
def test_headers_over_the_cap_are_answered_431_and_under_it_served(relay: RelayProcess) -> None:
    """A header block that goes on past MAX_HEADER_BYTES in later reads is answered 431
    with the relay's error body and its request id, and the connection closed; one of
    40 KiB (a large cookie, say) is served as any other."""
    piece = b"X-Pad-%d: " + b"p" * (40 << 10) + b"\r\n"
    with _connection(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.2)
        for number in range(3):  # each its own read: 80 KiB counted by the third
            sock.sendall(piece % number)
            time.sleep(0.2)
        head, error = _refused(sock)
    assert error["request_id"].encode() in head and error["request_id"].startswith("req_")
    with _connection(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + piece % 0 + b"\r\n")
        assert _answer(sock, 5).startswith(b"HTTP/1.1 200 ")


def _refused(sock: socket.socket) -> tuple[bytes, dict[str, str]]:
    """The ``431 headers_too_large`` a connection is answered before it is closed: its head
    and its error body (read to the close)."""
    received = _answer(sock, 5)
    sock.settimeout(5)
    while chunk := sock.recv(65536):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), received[:200]
    error: dict[str, str] = json.loads(body)["error"]
    assert error["code"] == "headers_too_large"
    return head, error


def _chunked_run(relay: RelayProcess) -> bytes:
    """A run's request whose body comes in chunks: its handler waits for the body's end."""
    token = relay.tokens["ops"]
    return (
        f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _fields(count: int) -> bytes:
    return b"".join(b"X-F-%d: v\r\n" % number for number in range(count))


@pytest.mark.slow  # needs a relay process: seconds
def test_more_header_fields_than_the_cap_are_answered_431_and_fewer_served(
    relay: RelayProcess,
) -> None:
    """Tiny header fields cost the relay far more per byte than one big one (13,000 fit
    under the byte cap; each is a tuple in uvicorn and a step of every header lookup): past
    MAX_HEADER_FIELDS, even in one read well under the byte cap, the request is answered
    431 with the relay's error body and the connection closed; 200 are served. A chunked
    body's trailer fields count too (uvicorn adds them to the request's headers)."""
    with _connection(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _fields(300) + b"\r\n")
        head, error = _refused(sock)
    assert "256 header fields" in error["message"]
    with _connection(relay) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _fields(200) + b"\r\n")
        assert _answer(sock, 5).startswith(b"HTTP/1.1 200 ")
    with _connection(relay) as sock:
        body = _chunk(b'{"job": "nosuchjob"}') + b"0\r\n" + _fields(300) + b"\r\n"
        sock.sendall(_chunked_run(relay) + body)
        assert _answer(sock, 5).startswith(b"HTTP/1.1 431 ")


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize("where", ["headers", "trailers"])
def test_requests_pipelined_before_one_over_the_field_cap_are_each_answered(
    relay: RelayProcess, where: str
) -> None:
    """Three requests in one send, the third over MAX_HEADER_FIELDS (in its headers, or its
    trailers): the second, read whole and waiting behind the first, is answered, then the
    third is refused. The 431 came right after the first answer, in the second's place (a
    caller took it for the second's), and the second was never run."""
    if where == "headers":
        refused = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _fields(300) + b"\r\n"
    else:
        body = _chunk(b'{"job": "nosuchjob"}') + b"0\r\n" + _fields(300) + b"\r\n"
        refused = _chunked_run(relay) + body
    with _connection(relay) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n" + refused
        )
        sock.settimeout(5)
        received = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                received += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"404", b"431"], received


TRAILER_LINE = b"X-T: " + b"t" * 1017 + b"\r\n"
"""One trailer field of 1 KiB."""


ENDLESS = {
    "trailer_value": (b"0\r\nX-T: ", b"t" * 1024),
    "trailer_fields": (b"0\r\n", TRAILER_LINE),
    "chunk_extension": (b"1;e=", b"e" * 1024),
}
"""What comes after a chunked body's first bytes, then again and again (1 KiB each)."""


@pytest.mark.slow  # needs a relay process: seconds
@pytest.mark.parametrize("shape", ENDLESS)
def test_endless_chunked_framing_is_cut_at_the_cap_not_kept(
    relay: RelayProcess, shape: str
) -> None:
    """A chunked body whose framing never ends, with no body bytes: a trailer's value that
    httptools kept whole, trailer fields uvicorn kept each, an extension nothing kept. The
    relay read on and held what it kept, bounded only by the body deadline (megabytes a
    second). Past MAX_HEADER_BYTES with no body bytes nothing more is read and the
    connection is closed: the caller's sends fail at once, or it is answered 431."""
    start, again = ENDLESS[shape]
    server = psutil.Process(relay.process.pid if relay.process else 0)
    assert relay.get(None, "/healthz").status_code == 200
    before = most = server.memory_info().rss
    refused = False
    received = b""
    with _connection(relay) as sock:
        try:
            sock.sendall(_chunked_run(relay) + _chunk(b'{"job": ') + start)
            for sent in range(10 << 10):  # 10 MiB
                sock.sendall(again)
                if sent % 64 == 0:  # what the relay holds while it reads (freed once closed)
                    most = max(most, server.memory_info().rss)
            received = _answer(sock, 5)
        except ConnectionError:
            refused = True
    assert most - before < 4 << 20
    assert refused or received.startswith(b"HTTP/1.1 431 "), received[:100]
    assert relay.get(None, "/healthz").status_code == 200


@pytest.mark.slow  # needs a relay process: seconds
def test_trailers_over_the_cap_are_answered_431_and_a_small_trailer_served(
    relay: RelayProcess,
) -> None:
    """Trailer fields past MAX_HEADER_BYTES, in reads that bring no body, are answered 431
    (the run's handler still waited for its body) and the connection closed; a chunked run
    with a small trailer is read whole and answered as any other (its job named back)."""
    with _connection(relay) as sock:
        sock.sendall(_chunked_run(relay) + _chunk(b'{"job": "nosuchjob"}') + b"0\r\n")
        time.sleep(0.2)
        sock.sendall(TRAILER_LINE * 65)  # 65 KiB: over the cap at its last byte
        head, error = _refused(sock)
    assert error["request_id"].encode() in head
    with _connection(relay) as sock:
        sock.sendall(
            _chunked_run(relay)
            + _chunk(b'{"job": ')
            + _chunk(b'"nosuchjob"}')
            + b"0\r\nX-Checksum: abc\r\n\r\n"
        )
        received = _answer(sock, 10)
    assert received.startswith(b"HTTP/1.1 422 "), received[:200]
    assert b"nosuchjob" in received


@pytest.mark.slow  # needs a relay process: seconds
def test_trailers_over_the_cap_after_an_early_answer_only_close(relay: RelayProcess) -> None:
    """A request answered before its body ended (a 401) whose trailers go on past the cap:
    its connection is closed, with no second answer after the one it had."""
    with _connection(relay) as sock:
        sock.sendall(_chunked_run(relay).replace(b"Bearer ", b"Bearer x") + _chunk(b"{}"))
        received = _answer(sock, 5)
        assert received.startswith(b"HTTP/1.1 401 "), received[:200]
        sock.sendall(b"0\r\n")
        time.sleep(0.2)
        sock.sendall(TRAILER_LINE * 65)
        sock.settimeout(5)
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                received += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"401"], received


def _ask_for_the_big_run(relay: RelayProcess, sock: socket.socket) -> None:
    token = relay.tokens["ops"]
    sock.sendall(
        f"GET /v1/runs/{BIG_RUN} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    )


def _length(head: bytes) -> int:
    return int(re.findall(rb"content-length: (\d+)", head.lower())[0])


@pytest.mark.slow  # needs a relay process: seconds
def test_a_caller_that_stops_reading_a_big_answer_is_cut_at_the_write_deadline(
    relay: RelayProcess,
) -> None:
    """It kept its connection and the answer's bytes in the relay (~12 MiB) for as long as
    it stayed connected: the keep-alive's close waited for it to read them."""
    with _connection(relay) as sock:
        _ask_for_the_big_run(relay, sock)
        time.sleep(DEADLINE_S * 1.25 + LATE_S)  # reads nothing meanwhile: the answer waits
        assert relay.get(None, "/healthz").status_code == 200
        received = b""
        ended = False
        sock.settimeout(0.5)
        with contextlib.suppress(TimeoutError):
            try:
                while chunk := sock.recv(1 << 20):
                    received += chunk
                ended = True
            except ConnectionError:  # reset: what the kernel held for it is dropped too
                ended = True
    assert ended, "the connection is still open, its answer waiting"
    head, _, body = received.partition(b"\r\n\r\n")
    if head:
        assert len(body) < _length(head), "the whole answer waited for a caller that left"


@pytest.mark.slow  # needs a relay process: seconds
def test_a_caller_reading_a_big_answer_slowly_but_steadily_gets_it_whole(
    relay: RelayProcess,
) -> None:
    """The write deadline is one on progress: the answer takes three write deadlines to
    read, but some of it is read every quarter of one, so it is never cut."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # the relay holds the rest
    sock.settimeout(5)
    with contextlib.closing(sock):
        sock.connect(("127.0.0.1", relay.port))
        started = time.monotonic()
        _ask_for_the_big_run(relay, sock)
        received = _answer(sock, 5)
        head, _, body = received.partition(b"\r\n\r\n")
        length = _length(head)
        step = length // 12 + 1
        while len(body) < length:
            time.sleep(DEADLINE_S / 4)
            wanted = min(length, len(body) + step)
            while len(body) < wanted:
                chunk = sock.recv(wanted - len(body))
                assert chunk, f"cut after {len(body)} of {length} bytes"
                body += chunk
    assert time.monotonic() - started > 2 * DEADLINE_S, "read too fast to test the deadline"
    assert body.endswith(b"}")


@pytest.mark.slow  # needs a relay process: seconds
def test_idle_kept_alive_connections_filling_the_cap_do_not_lock_out_a_new_caller(
    relay: RelayProcess,
) -> None:
    """Only a connection still sending its headers was closed to make room: the cap's worth
    of idle kept-alive connections shut every new caller out, ``/healthz`` included."""
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            held.append(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(sock, 5).startswith(b"HTTP/1.1 200")  # then idle, kept alive
        assert relay.get(None, "/healthz").status_code == 200
    finally:
        for sock in held:
            sock.close()


@pytest.mark.slow  # needs a relay process: seconds
def test_a_caller_reading_a_big_answer_steadily_through_big_buffers_is_not_cut(
    relay: RelayProcess,
) -> None:
    """The write deadline looked only at the relay's own buffer, which the kernel refills
    from only once a third of its send buffer (megabytes on a fast link) is free: a caller
    reading a steady 1 MiB/s through a 1 MiB receive buffer was cut within two deadlines,
    as if it had stopped. What the caller acknowledges is what counts now."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.settimeout(5)
    with contextlib.closing(sock):
        sock.connect(("127.0.0.1", relay.port))
        _ask_for_the_big_run(relay, sock)
        started = time.monotonic()
        received = 0
        while time.monotonic() - started < 4 * DEADLINE_S:  # a third of the answer
            time.sleep(DEADLINE_S / 4)
            assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), (
                f"cut after {received} bytes in {time.monotonic() - started:.1f} s"
            )
            chunk = sock.recv(STEADY_READ_BYTES)
            assert chunk, f"closed after {received} bytes"
            received += len(chunk)


PATIENT_WRITE_S = 8.0
"""The write deadline of the relay below: long enough that its reset is not what lets the
new caller in."""


@pytest.mark.slow  # needs a relay process: seconds
def test_callers_pipelining_answers_they_never_read_do_not_lock_out_a_new_caller(
    tmp_path: Path,
) -> None:
    """A connection with a request in flight was never closed for room, and a pipelined
    request waiting for its caller to read the answer before it is one: a caller with no
    token pipelining GET /openapi.json (60 KB) on the cap's worth of connections, reading
    nothing, shut every new caller out, /healthz included, until the write deadline reset
    them (37.5 s by default), and again as often as it reconnected."""
    relay = RelayProcess(tmp_path, write_timeout_s=PATIENT_WRITE_S, max_connections=MAX_CONNECTIONS)
    relay.add_token("ops")
    relay.start()
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", relay.port))
            sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
            held.append(sock)
        started = time.monotonic()
        while time.monotonic() - started < PATIENT_WRITE_S * 0.75:  # before any is reset
            with _connection(relay) as sock, contextlib.suppress(ConnectionError):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                if _answer(sock, 1).startswith(b"HTTP/1.1 200"):
                    return
            time.sleep(0.2)
        raise AssertionError("a new caller was shut out until the write deadline")
    finally:
        for sock in held:
            sock.close()
        relay.stop()
