"""Two tiny HTTP clients with almost no cost of their own, so they don't blur the figures.

:func:`post_and_close` — one POST on its own connection (``asyncio`` streams): a thousand
of them wait at once for the waiting-callers benchmark. :class:`KeepAliveClient` — one
``http.client`` connection reused for sequential calls (the local-provider benchmark).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit


def _request_bytes(host: str, path: str, body: bytes, token: str | None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def post_and_close(
    url: str, body: Mapping[str, Any], token: str | None
) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to ``url`` on a fresh connection; the status and the JSON answer."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        payload = json.dumps(body).encode()
        writer.write(_request_bytes(parts.netloc, parts.path, payload, token))
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, content = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    if b"transfer-encoding: chunked" in head.lower():
        content = _dechunk(content)
    try:
        data = json.loads(content) if content else {}
    except ValueError:
        data = {}
    return status, data if isinstance(data, dict) else {}


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


class KeepAliveClient:
    """Sequential JSON POSTs on one kept-alive connection."""

    def __init__(self, url: str, token: str | None) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.headers = {"Content-Type": "application/json"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.connection.request("POST", path, json.dumps(body), self.headers)
        response = self.connection.getresponse()
        data = json.loads(response.read())
        return response.status, data

    def close(self) -> None:
        self.connection.close()
