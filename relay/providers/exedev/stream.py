"""The relay's own HTTP to exe.dev: the transport that bounds every read, and the reader of a
command's NDJSON stream that keeps its bytes exact.

The SDK sets ``httpx.Timeout(600, connect=30)`` on every request it builds, which overrides
any client's own timeout: a create whose answer never comes would be waited on for ten
minutes, and a cancelled ``new()`` is shielded until that answer. :class:`BoundedReads`
rewrites each request's timeouts on its way out, so the SDK's calls end (``NetworkError``)
within the relay's bounds instead, and the relay never relies on cancelling ``new()``.

The SDK's live output callbacks get decoded lines without their endings: ``\\r\\n`` and a
last line without one come out the same, and bytes that are not UTF-8 are replaced. The
relay reads the stream itself (:func:`follow`): each ``{"stdout": base64}`` frame is written
to the run's output as it arrives, byte for byte.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import shlex
from dataclasses import dataclass, field

import httpx
from exedev import ProtocolError

# The SDK's own reading of a refused ``ssh`` (422 "VM not found" and "not running" become
# its NotFoundError and VMNotRunningError), so the provider's error table maps it once.
from exedev._errors import ssh_error

from relay.providers.contract import OutputSink, StreamName

STREAMS: tuple[StreamName, ...] = ("stdout", "stderr")
MAX_FRAME = 1 << 20
"""A line of the stream longer than this is not exe.dev's (the SDK refuses it too)."""


class BoundedReads(httpx.AsyncHTTPTransport):
    """Caps the timeouts of every request, whatever the SDK set: ``ssh`` streams may be
    quiet between heartbeats (exe.dev sends one about every 30 s), every other command is
    answered within exe.dev's own 30 s, or within the relay's create timeout if shorter."""

    def __init__(self, *, lobby_s: float, stream_s: float, connect_s: float) -> None:
        super().__init__()
        self.lobby_s, self.stream_s, self.connect_s = lobby_s, stream_s, connect_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        given = dict(request.extensions.get("timeout") or {})
        read = self.stream_s if request.content.startswith(b"ssh ") else self.lobby_s
        bounds = {"read": read, "connect": self.connect_s, "write": read, "pool": read}
        request.extensions["timeout"] = {
            name: min(bound, given.get(name) or math.inf) for name, bound in bounds.items()
        }
        return await super().handle_async_request(request)


@dataclass(frozen=True)
class Channel:
    """Where the relay's own requests go: the client (with :class:`BoundedReads`), the
    ``/exec`` URL, the headers the SDK would send (the token's among them), and how long a
    command's stream may be silent (set on each request: httpx's default is 5 s)."""

    http: httpx.AsyncClient
    url: str
    headers: dict[str, str]
    timeout: httpx.Timeout


@dataclass
class Followed:
    """What one request of a command's stream gave: its bytes (counted per stream), and its
    exit status, or None if it ended without one (cut, an ``error`` line, a broken read)."""

    received: dict[StreamName, int] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0))
    exit_code: int | None = None
    capped: StreamName | None = None
    """A stream whose output reached the cap during this request: it was left early, to be
    followed again from the end (what comes past the cap is dropped anyway)."""


async def follow(
    channel: Channel,
    vm: str,
    command: str,
    output: OutputSink,
    skipping: frozenset[StreamName],
) -> Followed:
    """POST ``ssh vm command`` and write its output into ``output`` as it arrives.

    A refused request raises the SDK's exception for it (mapped by the provider's table); a
    stream that ends early returns with what came (the caller follows again)."""
    followed = Followed()
    body = f"ssh {shlex.quote(vm)} {shlex.quote(command)}".encode()
    request = channel.http.build_request(
        "POST", channel.url, content=body, headers=channel.headers, timeout=channel.timeout
    )
    try:
        response = await channel.http.send(request, stream=True)
    except httpx.TransportError:
        return followed
    try:
        if response.status_code != 200:
            try:
                await response.aread()
            except httpx.TransportError:
                return followed
            raise ssh_error(vm, response.status_code, response.text)
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-ndjson":
            raise ProtocolError("ssh")
        buffer = bytearray()
        try:
            async for chunk in response.aiter_bytes():
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0:
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    if _frame(line, followed, output, skipping) or followed.capped:
                        return followed
                if len(buffer) > MAX_FRAME:
                    raise ProtocolError("ssh")
        except httpx.TransportError:
            return followed
        if buffer.strip():
            _frame(bytes(buffer), followed, output, skipping)
        return followed
    finally:
        await response.aclose()


def _frame(
    line: bytes, followed: Followed, output: OutputSink, skipping: frozenset[StreamName]
) -> bool:
    """Take one line of the stream; True once it said how the command ended."""
    if not line.strip():
        return False  # a heartbeat
    try:
        frame = json.loads(line)
    except ValueError:
        raise ProtocolError("ssh") from None
    if not isinstance(frame, dict) or len(frame) != 1:
        raise ProtocolError("ssh")
    ((key, value),) = frame.items()
    if key in STREAMS and isinstance(value, str):
        try:
            data = base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ProtocolError("ssh") from None
        stream: StreamName = "stdout" if key == "stdout" else "stderr"
        followed.received[stream] += len(data)
        output.write(stream, data)
        if stream not in skipping and output.truncated(stream):
            followed.capped = stream
        return False
    if key == "exit_code" and isinstance(value, int) and not isinstance(value, bool):
        followed.exit_code = value
        return True
    if key == "error" and isinstance(value, str):
        return True  # the command's end was not reported: its text is exe.dev's, never ours
    raise ProtocolError("ssh")
