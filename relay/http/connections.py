"""The HTTP connections the relay serves: slow or idle clients are dropped, and their
number is capped without shutting out a new caller.

uvicorn (0.54, its httptools protocol) closes a connection idle *between* requests after
``timeout_keep_alive``, but arms no timer before the first request nor while a request's
headers or body trickle in: a client that connects and never finishes its headers is
held for ever. Its ``limit_concurrency`` answers 503 to every new request once that many
connections are open, ``/healthz`` included, so it cannot keep the relay answering. Hence
:func:`guarded_protocol`, a small subclass of uvicorn's protocol that adds what is
missing:

- **header deadline**: a request's headers must be complete within ``header_timeout_s``
  of the connection opening (or of the first byte of a later request on it); otherwise
  the connection is closed. A deadline, not an idle timer, so trickling a byte at a time
  does not extend it;
- **body deadline**: once the headers are in, the whole body must arrive within
  ``body_timeout_s``; otherwise the connection is closed (the handler sees a disconnect);
- **connection cap**: past ``max_connections`` open connections, a new one makes room by
  closing the oldest connection still waiting for its headers (the cheapest to lose, and
  what a flood of half-sent requests is made of); if every connection is busy with a
  request, the new one is closed at once. A fresh ``/healthz`` therefore always gets in.

Keep-alive between requests stays uvicorn's ``timeout_keep_alive``, timed by the same one
timer a connection as the deadlines: it is moved only when a deadline comes sooner than it
fires, so a kept-alive connection's requests arm and disarm theirs without a timer each.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

JOINED_BODY_BYTES = 64 * 1024
"""The largest body an answer's head is joined to: a bigger one would be copied whole (a
run's answer can be megabytes) to save one send of many."""


class OneSend:
    """A connection's transport as its protocol writes to it: the head of an answer that
    names its length (``Content-Length`` above 0, up to :data:`JOINED_BODY_BYTES`) is held
    and written with the body's first write, as one send. Anything else passes at once: a
    streamed answer's head (its body may take a while), a ``HEAD`` answer's (it has no
    body), a bigger answer's (joining would copy its body, for a send that is one of many),
    a ``100 Continue``, uvicorn's own ``400``. Held bytes never wait past the next write,
    nor a close (written first, as uvicorn would have)."""

    __slots__ = ("answered", "held", "protocol", "transport")

    def __init__(self, transport: asyncio.Transport, protocol: HttpToolsProtocol) -> None:
        self.transport = transport
        self.protocol = protocol
        self.held: bytes | None = None
        self.answered: RequestResponseCycle | None = None
        """The request whose head was written last (the next write of its answer is a body)."""

    def write(self, data: bytes) -> None:
        held = self.held
        if held is not None:
            self.held = None
            self.transport.write(held + data)
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
        self.transport.write(data)

    def close(self) -> None:
        held = self.held
        if held is not None:
            self.held = None
            self.transport.write(held)
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def guarded_protocol(
    *, header_timeout_s: float, body_timeout_s: float, max_connections: int
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the deadlines and the cap above (one class per
    server: the connections waiting for their headers are its own)."""
    waiting: OrderedDict[GuardedProtocol, None] = OrderedDict()

    class GuardedProtocol(HttpToolsProtocol):
        """One connection, with its header or body deadline."""

        _due: float | None = None
        """When the current deadline passes (the loop's clock); None: none is running."""
        _timer: asyncio.TimerHandle | None = None
        _timer_at = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(OneSend(transport, self))  # type: ignore[arg-type]
            if len(self.connections) > max_connections and not self._make_room():
                transport.close()
                return
            self._await_headers()

        def _make_room(self) -> bool:
            """Close the oldest connection still sending its headers; False if none."""
            while waiting:
                oldest, _ = waiting.popitem(last=False)
                if not oldest.transport.is_closing():
                    oldest._close()
                    return True
            return False

        def _await_headers(self) -> None:
            self._arm(header_timeout_s)
            waiting[self] = None

        def _arm(self, seconds: float) -> None:
            # One timer a connection, moved only when a deadline comes sooner than it
            # fires: a later deadline is found by the timer when it fires (_expire), so a
            # kept-alive connection's requests arm and disarm theirs without a timer each.
            due = self._due = self.loop.time() + seconds
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
            due = self._due
            if due is None:
                return
            if self.loop.time() < due:  # armed again since, for later
                self._set_timer(due)
                return
            self._close()

        def _close(self) -> None:
            self._stop()
            waiting.pop(self, None)
            if not self.transport.is_closing():
                self.transport.close()

        def _stop(self) -> None:
            self._due = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self not in waiting:  # a later request on a kept-alive connection
                self._await_headers()

        def on_headers_complete(self) -> None:
            waiting.pop(self, None)
            self._arm(body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            # uvicorn's (0.54), with its keep-alive timer, armed after every answer and
            # canceled by the next request, replaced by this connection's one timer: idle
            # for keep-alive, until the next request's first byte arms its header deadline.
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            elif self not in waiting:  # else a next request began: its header deadline holds
                self._arm(self.timeout_keep_alive)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop()
            waiting.pop(self, None)
            super().connection_lost(exc)

    return GuardedProtocol


def server_options(
    *,
    header_timeout_s: float,
    body_timeout_s: float,
    keep_alive_s: float,
    max_connections: int,
) -> dict[str, Any]:
    """The uvicorn.Config options that bound the relay's connections."""
    protocol = guarded_protocol(
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        max_connections=max_connections,
    )
    return {"http": protocol, "timeout_keep_alive": keep_alive_s}
