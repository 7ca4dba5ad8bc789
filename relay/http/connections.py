"""The HTTP connections the relay serves: slow, silent or idle clients are dropped, and
their number is capped without shutting out a new caller.

uvicorn (0.54, its httptools protocol) closes a connection idle *between* requests after
``timeout_keep_alive``, but arms no timer before the first request nor while a request's
headers or body trickle in: a client that connects and never finishes its headers is
held for ever. Nothing bounds an answer's write either: a caller that stops reading keeps
the answer's bytes in the transport's buffer (megabytes for a run's answer) and its
connection for as long as it stays connected, and a close waits for those bytes too. Its
``limit_concurrency`` answers 503 to every new request once that many connections are open,
``/healthz`` included, so it cannot keep the relay answering. Hence :func:`guarded_protocol`,
a small subclass of uvicorn's protocol that adds what is missing:

- **header deadline**: a request's headers must be complete within ``header_timeout_s``
  of the connection opening (or of the first byte of a later request on it); otherwise
  the connection is closed. A deadline, not an idle timer, so trickling a byte at a time
  does not extend it;
- **header cap**: a request's headers (its request line and header fields) may take at
  most :data:`MAX_HEADER_BYTES`; past it the request is answered ``431`` and the connection
  closed. httptools keeps a header block whole however long it is, so without a cap the
  header deadline alone bounded it, and a cap's worth of connections could each hold what
  they sent within it (tens of megabytes each, on loopback). Counted from the reads that
  come after the one that began the request (at most one read more: asyncio's 256 KiB);
- **field cap**: a request may have at most :data:`MAX_HEADER_FIELDS` header fields, its
  trailers included; past it, answered ``431`` and closed as above. A field costs uvicorn,
  Starlette and every lookup of a header far more than its bytes: 13,000 tiny ones fit
  under the byte cap;
- **framing cap**: once the headers are in, reads in a row that bring no body bytes (a
  chunked body's size lines, extensions and trailers: httptools keeps a trailer whole, and
  uvicorn each trailer field) may take at most :data:`MAX_HEADER_BYTES` (the read the
  headers ended in aside); past it the connection is closed, answered ``431`` first if the
  request was not answered yet (its handler sees a disconnect). Else only the body
  deadline bounded them, megabytes a second on loopback;
- **body deadline**: once the headers are in, the whole body must arrive within
  ``body_timeout_s``; otherwise the connection is closed (the handler sees a disconnect);
- **write deadline**: while an answer's bytes wait in the transport (asyncio's buffer, past
  what the kernel took), the caller must acknowledge some of the answer within
  ``write_timeout_s`` (looked at every quarter of it; :meth:`OneSend.taken`, not what left
  asyncio's buffer, which stands still while the kernel's megabytes drain); if it did
  not, the connection is reset, which drops them, here and in the kernel. A deadline on
  progress, not on the whole answer: a slow caller that keeps reading a big answer is
  never cut (one reading less than its window's update, a few KiB, a timeout is seen as
  stopped), one that stops is cut within 1¼ of the timeout, whoever closed the connection
  meanwhile (its keep-alive, or uvicorn after a handler failed mid-answer: a close waits
  for the caller to take what is left);
- **connection cap**: past ``max_connections`` open connections, a new one makes room by
  closing the oldest connection with no request in flight: one still sending its headers
  (what a flood of half-sent requests is made of) or one idle between requests (HTTP lets a
  server close it; its client retries); one whose caller still sends the body of a request
  answered early (a 401, a 413) only when there is no other; then one whose caller took
  none of its answer since the write deadline last looked (reset, as that deadline would,
  request in flight or not: a cap's worth of callers pipelining answers they never read
  shut out every new one). One with a request in flight whose caller reads, or an answer
  still leaving to it, is never closed for room; if every connection is one, the new one
  is closed at once. A fresh ``/healthz`` therefore gets in.

Keep-alive between requests stays uvicorn's ``timeout_keep_alive``, timed by the same one
timer a connection as the deadlines: it is moved only when a deadline comes sooner than it
fires, so a kept-alive connection's requests arm and disarm theirs without a timer each;
a request's header and body deadlines are set once the data that began them is parsed, so
a request that comes whole in one read sets neither. A request pipelined behind another
has none while uvicorn reads nothing more of the connection (until that one is answered):
its deadline starts when reading does, so it cannot close the connection under the answer
before it.

The relay serves no WebSockets (uvicorn's ``ws="none"``): an ``Upgrade:`` request is answered
as the plain HTTP request it also is, with the relay's one access line, and its connection
closed after that answer (uvicorn's parser stops at an upgrade).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import secrets
import socket
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from relay.errors import HeadersTooLarge

JOINED_BODY_BYTES = 64 * 1024
"""The largest body an answer's head is joined to: a bigger one would be copied whole (a
run's answer can be megabytes) to save one send of many."""

WRITE_LOOKS = 4
"""How many times within ``write_timeout_s`` a connection whose answer's bytes wait looks
whether some left: a caller that reads nothing is cut within 1 + 1/4 of the timeout."""

OUT_QUEUE = getattr(termios, "TIOCOUTQ", 0x5411)
"""The ``ioctl`` that reads a socket's unacknowledged bytes (``SIOCOUTQ`` on Linux)."""
QUEUED = bytes(4)
"""Its argument: an int's room."""

RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 s: the close of a connection cut at its write deadline is a reset,
which drops what the kernel still holds for the caller, rather than an orderly close that
would keep it until the caller reads it."""


def _queued(transport: asyncio.BaseTransport) -> int:
    """Bytes a connection's kernel holds that the caller has not acknowledged (Linux's
    ``SIOCOUTQ``); 0 where it cannot tell (no socket, closed, another system)."""
    connected = transport.get_extra_info("socket")
    if connected is None:
        return 0
    try:
        queued: int = struct.unpack("i", fcntl.ioctl(connected.fileno(), OUT_QUEUE, QUEUED))[0]
    except (OSError, ValueError):
        return 0
    return queued


class OneSend:
    """A connection's transport as its protocol writes to it: the head of an answer that
    names its length (``Content-Length`` above 0, up to :data:`JOINED_BODY_BYTES`) is held
    and written with the body's first write, as one send. Anything else passes at once: a
    streamed answer's head (its body may take a while), a ``HEAD`` answer's (it has no
    body), a bigger answer's (joining would copy its body, for a send that is one of many),
    a ``100 Continue``, uvicorn's own ``400``. Held bytes never wait past the next write,
    nor a close (written first, as uvicorn would have). The bytes written are counted, so
    the write deadline can tell whether the caller took any (:meth:`sent`); ``on_close`` is
    told of every close, uvicorn's own included (a handler that failed mid-answer)."""

    __slots__ = ("answered", "held", "on_close", "protocol", "transport", "written")

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: HttpToolsProtocol,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.transport = transport
        self.protocol = protocol
        self.on_close = on_close
        self.held: bytes | None = None
        self.answered: RequestResponseCycle | None = None
        """The request whose head was written last (the next write of its answer is a body)."""
        self.written = 0
        """Bytes handed to the transport since the connection opened."""

    def unsent(self) -> int:
        """Bytes handed to the transport that the kernel has not taken yet."""
        return self.transport.get_write_buffer_size()

    def sent(self) -> int:
        """Bytes the kernel took since the connection opened (it takes them as the caller
        reads, once its own buffer is full)."""
        return self.written - self.transport.get_write_buffer_size()

    def taken(self) -> int:
        """Bytes the caller's side acknowledged since the connection opened: :meth:`sent`
        less what the kernel still holds for it. The kernel takes more of the answer only
        once a third of its send buffer is free (megabytes, autotuned), so :meth:`sent`
        stands still for a caller that reads steadily but slower than that in a write
        timeout; an acknowledgement comes each time the caller's reads open its window."""
        return self.sent() - _queued(self.transport)

    def write(self, data: bytes) -> None:
        held = self.held
        if held is not None:
            self.held = None
            data = held + data
            self.written += len(data)
            self.transport.write(data)
            return
        cycle = self.protocol.cycle
        if cycle is not None and cycle is not self.answered and cycle.response_started:
            self.answered = cycle  # the first write once the answer started: its head
            if (
                cycle.chunked_encoding is False
                and 0 < cycle.expected_content_length <= JOINED_BODY_BYTES
                and cycle.scope["method"] != "HEAD"  # its length, but no body will come
            ):
                self.held = data
                return
        self.written += len(data)
        self.transport.write(data)

    def close(self) -> None:
        held = self.held
        if held is not None:
            self.held = None
            self.written += len(held)
            self.transport.write(held)
        self.transport.close()
        if self.on_close is not None:
            self.on_close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


MAX_HEADER_BYTES = 64 * 1024
"""The most a request's headers may take, its request line included (nginx's default is
32 KiB, Node's 16 KiB): well above any caller's, and what the relay holds for one. A
chunked body's framing with no body bytes in between (size lines, extensions, trailers) is
held to it too."""

MAX_HEADER_FIELDS = 256
"""The most header fields a request may have, its trailers included (Apache's default is
100): well above any caller's (a browser sends a dozen or two)."""


class _TooManyFields(Exception):
    """Raised from the parser's callback at the field past :data:`MAX_HEADER_FIELDS`, which
    stops the parse there (httptools has no pause): :meth:`GuardedProtocol._parse` tells it
    from a malformed request."""


log = logging.getLogger("relay.http")


def _headers_too_large(message: str) -> tuple[bytes, str]:
    """A ``431`` answer, whole, as the relay's error body, and its request id."""
    request_id = f"req_{secrets.token_hex(8)}"
    body = json.dumps(
        {
            "error": {
                "code": HeadersTooLarge.code,
                "message": message,
                "request_id": request_id,
            }
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"HTTP/1.1 {HeadersTooLarge.status} Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"x-request-id: {request_id}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body, request_id


def guarded_protocol(
    *,
    header_timeout_s: float,
    body_timeout_s: float,
    write_timeout_s: float,
    max_connections: int,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the deadlines and the cap above (one class per
    server: the connections it may close to make room are its own)."""
    unoccupied: OrderedDict[GuardedProtocol, None] = OrderedDict()
    """The connections with no request in flight and no answer's bytes waiting (sending a
    request's headers, or idle between requests), in the order they became so: the first is
    the one to close for room. Only those, so that making room looks at one or two: one
    passed over on every new connection made each cost the cap's worth of looks."""
    uploading: OrderedDict[GuardedProtocol, None] = OrderedDict()
    """As ``unoccupied``, those whose caller still sends the body of a request answered
    early (a 401, a 413): closed for room only when no connection above is left."""
    stalled: OrderedDict[GuardedProtocol, None] = OrderedDict()
    """The connections whose answer's bytes wait and whose caller took none of them since
    the write deadline last looked, in the order they stalled: reset for room when no
    connection above is left, request in flight or not, as their write deadline will (a
    caller with no token could otherwise hold the cap with answers it never reads)."""

    class GuardedProtocol(HttpToolsProtocol):
        """One connection, with its header, body and write deadlines."""

        _sending: OneSend
        _transport: asyncio.Transport
        """The connection's own transport (``self.transport`` is the :class:`OneSend` around
        it, whose other methods pass through ``__getattr__``)."""
        _due: float | None = None
        """When the current request deadline passes (the loop's clock); None: none runs."""
        _heading = False
        """A request's headers are being read: its header deadline runs."""
        _header_bytes = 0
        """What the reads after the one that began the request brought while its headers
        were still being read (:data:`MAX_HEADER_BYTES`)."""
        _header_began = False
        """The request began in the read being parsed (not counted: it may hold the end of
        the request before it)."""
        _fields = 0
        """The request's header fields so far, its trailers' included."""
        _refusing: str | None = None
        """Headers over a cap came behind a request still being answered: ``431`` after it,
        with this message."""
        _receiving = False
        """A request's body is being read (its answer may have been given before it)."""
        _body_began = False
        """The request's headers ended in the read being parsed (not counted as framing)."""
        _body_came = False
        """The read being parsed brought body bytes."""
        _framing_bytes = 0
        """What the reads in a row since the request's last body bytes brought (chunk size
        lines, extensions, trailers), once its headers are in (:data:`MAX_HEADER_BYTES`)."""
        _write_due: float | None = None
        """When the write deadline next looks at the answer's bytes; None: none wait."""
        _write_moved_at = 0.0
        """When some of them were last seen to leave (or the watch began)."""
        _write_sent = 0
        """:meth:`OneSend.taken` when last looked at."""
        _timer: asyncio.TimerHandle | None = None
        _timer_at = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._transport = transport
            self._sending = OneSend(transport, self, self._closed)
            super().connection_made(self._sending)  # type: ignore[arg-type]
            if len(self.connections) > max_connections and not self._make_room():
                transport.close()
                return
            self._await_headers()

        def _make_room(self) -> bool:
            """Close the oldest connection with no request in flight; False if none. One
            whose caller still sends the body of a request answered early (a 401, a 413) is
            cut in the middle of its upload, so it goes only when no other can; it still
            goes then, or callers with no token could hold the cap that way."""
            for table in (unoccupied, uploading):
                while table:
                    oldest = next(iter(table))
                    if oldest._unoccupied():
                        oldest._close()
                        return True
                    del table[oldest]  # closing already: gone soon
            if stalled:
                next(iter(stalled))._reset()
                return True
            return False

        def _unoccupied(self) -> bool:
            """Closing it loses no request in flight, and no answer (not even its last
            bytes); an answered request's body may still be coming."""
            cycle = self.cycle
            return (
                (cycle is None or cycle.response_complete)
                and not self.pipeline
                and not self._transport.get_write_buffer_size()
                and not self._transport.is_closing()
            )

        def _await_headers(self) -> None:
            self._heading = True
            self._arm(header_timeout_s)
            self._may_go()

        def _may_go(self) -> None:
            """List it for :meth:`_make_room` if closing it loses nothing now; if something
            is in flight, whatever ends that lists it then (its answer's end, its body's,
            the last of its bytes taken). Listed already, it keeps its place."""
            if self._unoccupied():
                (uploading if self._receiving else unoccupied)[self] = None

        def _arm(self, seconds: float) -> None:
            due = self._due = self.loop.time() + seconds
            self._wake_by(due)

        def _wake_by(self, due: float) -> None:
            # One timer a connection, moved only when a deadline comes sooner than it
            # fires: a later deadline is found by the timer when it fires (_expire), so a
            # kept-alive connection's requests arm and disarm theirs without a timer each.
            if self._timer is None or due < self._timer_at:
                self._set_timer(due)

        def _set_timer(self, due: float) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(due, self._expire)
            self._timer_at = due

        def _disarm(self) -> None:
            self._due = None

        def _expire(self) -> None:
            self._timer = None
            now = self.loop.time()
            write_due = self._write_due
            if write_due is not None and now >= write_due and not self._look_at_writes(now):
                return
            due = self._due
            if due is not None and now >= due:
                self._close()
            # What is left (armed again since, for later; or the write deadline) wakes it.
            due, write_due = self._due, self._write_due
            if write_due is not None and (due is None or write_due < due):
                due = write_due
            if due is not None:
                self._wake_by(due)

        def pause_writing(self) -> None:
            # The transport holds more of an answer than its high-water mark: the kernel
            # takes no more, so the caller is not reading (or reads slowly).
            super().pause_writing()
            self._watch_writes()

        def _watch_writes(self) -> None:
            """An answer's bytes wait: from now on, some must leave every write timeout."""
            if self._write_due is None:
                now = self._write_moved_at = self.loop.time()
                self._write_sent = self._sending.taken()
                self._write_due = now + write_timeout_s / WRITE_LOOKS
                self._wake_by(self._write_due)

        def _look_at_writes(self, now: float) -> bool:
            """Whether the connection stays: its bytes all left (the watch ends), some left
            since the last look, or it is not yet the write timeout since some did."""
            sending = self._sending
            if not sending.unsent():
                self._write_due = None
                stalled.pop(self, None)
                self._may_go()
                return True
            sent = sending.taken()
            if sent > self._write_sent:
                self._write_sent = sent
                self._write_moved_at = now
                stalled.pop(self, None)
            elif now - self._write_moved_at >= write_timeout_s:
                self._reset()
                return False
            else:
                stalled[self] = None  # listed already, it keeps its place
            self._write_due = min(
                now + write_timeout_s / WRITE_LOOKS, self._write_moved_at + write_timeout_s
            )
            return True

        def _reset(self) -> None:
            """Drop the connection and the bytes waiting for it (a close would wait for
            the caller to take them)."""
            self._stop()
            self._unlist()
            connected = self.transport.get_extra_info("socket")
            if connected is not None:
                with contextlib.suppress(OSError):
                    connected.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
            self.transport.abort()

        def _closed(self) -> None:
            """The transport was closed, by this class or by uvicorn itself (a handler that
            failed after its answer's head, or returned without its end; a malformed
            request's 400): the close waits for the caller to take what is left, so those
            bytes keep their write deadline."""
            if self._sending.unsent():
                self._watch_writes()

        def _unlist(self) -> None:
            unoccupied.pop(self, None)
            uploading.pop(self, None)
            stalled.pop(self, None)

        def _close(self) -> None:
            self._due = None
            self._unlist()
            if not self.transport.is_closing():
                self.transport.close()
            if self._sending.unsent():  # the close waits for them: they keep their deadline
                self._watch_writes()
            else:
                self._stop()

        def _stop(self) -> None:
            self._due = self._write_due = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def data_received(self, data: bytes) -> None:
            self._body_came = False
            over = self._parse(data)
            if over is not None:
                self._refuse(over)
                return
            if self._heading and not self._transport.is_closing():
                if self._header_began:
                    self._header_began = False
                else:
                    self._header_bytes += len(data)
                    if self._header_bytes > MAX_HEADER_BYTES:
                        self._refuse(f"the request's headers are over {MAX_HEADER_BYTES} bytes")
                        return
            elif self._receiving and not self._transport.is_closing():
                if self._body_began:
                    self._body_began = False
                elif self._body_came:
                    self._framing_bytes = 0
                else:
                    self._framing_bytes += len(data)
                    if self._framing_bytes > MAX_HEADER_BYTES:
                        self._refuse(
                            f"the request's chunked framing (size lines, extensions, trailers)"
                            f" is over {MAX_HEADER_BYTES} bytes with no body bytes"
                        )
                        return
            # The deadline of what this data began and did not finish, armed once it is
            # parsed: a request whose headers (or body) came whole in it arms none. The
            # loop's clock is the same all through this callback, so the deadline is the
            # one it would have been when its first byte was parsed. Behind a pipelined
            # request (uvicorn reads no more until the one before it is answered) none
            # runs: it starts when reading does (on_response_complete).
            if self._due is None and not self.pipeline:
                self._arm_unfinished()

        def _arm_unfinished(self) -> None:
            """The deadline of the request being read, if its headers or body are not all
            in yet."""
            if self._heading:
                self._arm(header_timeout_s)
            elif self._receiving:
                self._arm(body_timeout_s)

        def _parse(self, data: bytes) -> str | None:
            """uvicorn's ``data_received`` (0.54), but a request past the field cap is told
            from a malformed one (its ``400``): what it was refused for, then."""
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as error:
                if isinstance(error.__context__, _TooManyFields):
                    return str(error.__context__)
                message = "Invalid HTTP request received."
                self.logger.warning(message)
                self.send_400_response(message)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            return None

        def _refuse(self, message: str) -> None:
            """The request is over a cap: nothing more of the connection is read, and it is
            closed. Nothing of it reached the app (its headers not all in, or it waits behind
            a pipelined request): answered ``431``, after the answers of the requests before
            it (in flight, or pipelined and read whole: each is still served), not in the
            middle of one. Its body being read, it is answered
            ``431`` only if its handler answered nothing yet; the handler sees a disconnect,
            and what it answers goes nowhere."""
            self._transport.pause_reading()
            cycle = self.cycle  # the newest request: the one over the cap once its headers are in
            if self._heading or self.pipeline:
                if not self._heading and self.pipeline[0][0] is cycle:
                    self.pipeline.popleft()  # it waited behind another (its trailers): never run
                self._heading = self._receiving = False
                if cycle is not None and not cycle.response_complete:
                    self._refusing = message  # answered once the one before it is
                    self._due = None  # reading stopped: what it holds is bounded already
                    return
                self._answer_431(message)
                return
            self._receiving = False
            if cycle is None or cycle.response_complete:
                self._close()
                return
            answered = cycle.response_started
            cycle.disconnected = True  # as uvicorn's connection_lost will, but at once
            cycle.message_event.set()
            if answered:
                self._close()
            else:
                self._answer_431(message)

        def _answer_431(self, message: str) -> None:
            answer, request_id = _headers_too_large(message)
            log.warning(
                "%s: answered 431 and closed",
                message,
                extra={"request_id": request_id, "status": 431},
            )
            self.transport.write(answer)
            self._close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = self._fields = 0
            self._header_began = True
            if not self._heading:  # a later request on a kept-alive connection
                self._heading = True
                self._due = None  # the header deadline: armed once this data is parsed
                if self not in unoccupied:  # listed already, it keeps its place
                    self._may_go()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += 1
            if self._fields > MAX_HEADER_FIELDS:
                raise _TooManyFields(f"the request has over {MAX_HEADER_FIELDS} header fields")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._heading = False
            self._receiving = self._body_began = True
            self._framing_bytes = 0
            self._unlist()
            self._due = None  # the body deadline: armed once this data is parsed
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_came = True
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._receiving = False
            self._disarm()
            super().on_message_complete()
            if self in uploading:  # answered early, its body now in: idle from now on
                del uploading[self]
                self._may_go()

        def on_response_complete(self) -> None:
            # uvicorn's (0.54), with its keep-alive timer, armed after every answer and
            # canceled by the next request, replaced by this connection's one timer: idle
            # for keep-alive, until the next request's first byte arms its header deadline.
            self.server_state.total_requests += 1
            refusing = self._refusing
            if refusing is not None and not self.pipeline:  # the ones before it answered
                self._answer_431(refusing)
                return
            transport = self._transport
            if transport.get_write_buffer_size():  # the answer is written but not all taken
                self._watch_writes()
            if transport.is_closing():
                return
            self._unset_keepalive_if_required()
            if refusing is None:  # else nothing more is read: the parser stopped at it
                self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
                if not self.pipeline and self._due is None:  # reading again: its deadline
                    self._arm_unfinished()
            else:
                if not self._heading:  # else a next request began: its header deadline holds
                    self._arm(self.timeout_keep_alive)
                self._may_go()

        def _unsupported_upgrade_warning(self) -> None:
            # An `Upgrade:` request (a WebSocket's, h2c): the relay serves none (uvicorn's
            # ws="none", server_options), so it is answered as the plain request it also is,
            # with its one access line, not uvicorn's warnings. The parser stops at an
            # upgrade, so the connection ends with that answer (`Connection: close`).
            if self.cycle is not None:
                self.cycle.keep_alive = False

        def connection_lost(self, exc: Exception | None) -> None:
            self._unlist()
            super().connection_lost(exc)  # closes the transport: stopped after that
            self._stop()

    return GuardedProtocol


def server_options(
    *,
    header_timeout_s: float,
    body_timeout_s: float,
    write_timeout_s: float,
    keep_alive_s: float,
    max_connections: int,
) -> dict[str, Any]:
    """The uvicorn.Config options that bound the relay's connections."""
    protocol = guarded_protocol(
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        write_timeout_s=write_timeout_s,
        max_connections=max_connections,
    )
    # ws="none": the relay serves no WebSockets; an attempt is answered as the HTTP request
    # it is (a 401, a 404: one access line), not by uvicorn's WebSocket layer, which refused
    # it with a 403 and two info lines of its own and none of the relay's.
    return {"http": protocol, "ws": "none", "timeout_keep_alive": keep_alive_s}
