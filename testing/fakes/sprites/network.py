"""A sprite's network policy in the fake: rules applied first-match, checked by a proxy.

The Sprites docs show a policy as a list of ``{domain, action}`` rules whose example puts
the allowed domains first and ``{"domain": "*", "action": "deny"}`` last; they do not say
how rules combine. The fake reads them as most firewalls do, and as the docs' example needs
to mean what it says: the first rule whose domain matches a host decides; no rule matching
leaves the host reachable (no policy is the open network).

* A policy under which no host can be reached (a ``*`` deny before any allow) runs the
  sprite's commands with no network at all (a private network namespace, with bubblewrap).
* Any other policy with rules gives the sprite an HTTP proxy on 127.0.0.1, named in its
  default environment (``http_proxy``…): each request's host is checked against the rules
  there, and an allowed host is reached only if a test mapped it (:attr:`Proxy.hosts`) to a
  local server, so no test ever leaves the machine. The fake is no firewall: a command that
  ignores the proxy variables is not stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

Rule = Mapping[str, Any]
HEAD_LIMIT = 65_536


def matches(pattern: str, host: str) -> bool:
    """``*`` matches every host, ``*.example.com`` its subdomains, anything else itself."""
    pattern, host = pattern.lower(), host.lower().rstrip(".")
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def allows(rules: Sequence[Rule], host: str) -> bool:
    """The first rule whose domain matches ``host`` decides; none matching: allowed."""
    for rule in rules:
        domain = rule.get("domain")
        if isinstance(domain, str) and matches(domain, host):
            return rule.get("action") == "allow"
    return True


def closed(rules: Sequence[Rule]) -> bool:
    """Whether no host at all can be reached: a ``*`` deny comes before any allow."""
    for rule in rules:
        if rule.get("action") == "allow":
            return False
        if rule.get("domain") == "*" and rule.get("action") == "deny":
            return True
    return False


class Proxy:
    """One sprite's HTTP proxy (plain requests and ``CONNECT``), deciding by its rules."""

    def __init__(
        self,
        rules: Callable[[], Sequence[Rule]],
        hosts: Mapping[str, tuple[str, int]],
        record: Callable[[str, bool], None],
    ) -> None:
        self._rules = rules
        self.hosts = hosts
        self._record = record
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def close(self) -> None:
        """Stop listening and cut every connection (they end on the loop)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._relay(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > HEAD_LIMIT:
            raise ValueError("request head too large")
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        if method == "CONNECT":
            host = target.rsplit(":", 1)[0].strip("[]")
        else:
            host = urlsplit(target).hostname or ""
        allowed = allows(self._rules(), host)
        self._record(host, allowed)
        if not allowed:
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            return
        address = self.hosts.get(host.lower())
        if address is None:  # allowed, but nothing on this machine answers for it
            writer.write(
                b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*address)
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            upstream_writer.write(head)
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            upstream_writer.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    while chunk := await source.read(65_536):
        sink.write(chunk)
        await sink.drain()
    with contextlib.suppress(OSError):
        if sink.can_write_eof():
            sink.write_eof()
