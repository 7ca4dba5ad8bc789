"""Who may open ``/mcp`` sessions, and how many.

- **Origin.** The MCP Streamable HTTP transport requires a server to check ``Origin``, so that
  a web page (whose DNS name an attacker rebinds to the relay's address) cannot drive it from
  a browser. A request that carries one must come from the relay's own origin
  (``RELAY_PUBLIC_URL``'s; without it, the loopback addresses at ``RELAY_PORT``) or from one
  in ``RELAY_MCP_ALLOWED_ORIGINS``; any other is ``403`` before its token is read or a session
  made. A request without ``Origin`` (a server-side client, which is what connectors are)
  passes.
- **The cap.** One token *value* holds at most :data:`MAX_SESSIONS_PER_TOKEN` sessions.
  Counted by value, not by name: when a leaked token is rotated, its new value starts with
  room, whatever the old one opened. The SDK pins each session to its owner (the token's
  name and its value's SHA-256), and when the token file reloads, the sessions of a value no
  longer in it are closed at once (their calls end, their runs are canceled), so they stop
  counting and stop running.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from relay.auth import hash_token
from relay.cancellation import shielded
from relay.errors import Forbidden, RateLimited
from relay.settings import Settings, origin_of

if TYPE_CHECKING:
    from mcp.server.streamable_http import StreamableHTTPServerTransport
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from relay.auth import Principal, TokenStore

MAX_SESSIONS_PER_TOKEN = 32
"""Open sessions one token value may hold: a session lives until it idles 30 minutes, and the
SDK's room (10 000) is shared, so one token must not fill it and lock the others out."""
EXPIRY_LOOK_S = 30.0
"""How often the sessions' keeper looks for a value that stopped being valid."""
OWNER_SEPARATOR = "#"
"""Between a session owner's token name and its value's digest (names hold no '#')."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def own_origins(settings: Settings) -> frozenset[str]:
    """The origins whose pages may call ``/mcp``: the relay's own and the allowed ones."""
    origins = set(settings.mcp_allowed_origins)
    if settings.public_url is not None:
        origins.add(origin_of(settings.public_url))
    else:
        # No public URL: the relay as this machine reaches it. A rebound DNS name never
        # yields these (the browser writes the attacker's name in Origin).
        origins.update(f"http://{host}:{settings.port}" for host in LOOPBACK_HOSTS)
    return frozenset(origins)


def check_origin(origin: str | None, allowed: frozenset[str]) -> None:
    """Refuse a request whose ``Origin`` is there and not allowed (raises Forbidden)."""
    if origin is None:
        return
    try:
        normal = origin_of(origin)
    except ValueError:
        normal = None  # "null" (a sandboxed frame, a file), or anything else no page has
    if normal not in allowed:
        raise Forbidden(
            "this Origin may not use /mcp (a page elsewhere than the relay); set "
            "RELAY_PUBLIC_URL to the relay's URL, or list the page's origin in "
            "RELAY_MCP_ALLOWED_ORIGINS"
        )


class SessionOwners:
    """Who opened each session, how many a token value holds, and closing a revoked value's."""

    def __init__(self, manager: StreamableHTTPSessionManager, tokens: TokenStore) -> None:
        self.manager = manager
        self.tokens = tokens
        self.closing: TaskGroup | None = None
        """Where closed sessions' transports are terminated (set while the app runs)."""
        self._reloaded = anyio.Event()
        tokens.on_reload(self.close_revoked)

    def user(self, principal: Principal, token: str) -> AuthenticatedUser:
        """The SDK user for a request with ``token``: the SDK pins each session to it, so a
        session answers only the value that opened it (a rotated token's new value, or a new
        token given a revoked one's name, does not inherit it)."""
        owner = f"{principal.name}{OWNER_SEPARATOR}{hash_token(token)}"
        return AuthenticatedUser(AccessToken(token=owner, client_id=owner, scopes=[]))

    def refuse_past_cap(self, token: str) -> None:
        """Raise RateLimited if this token value holds every session it may."""
        digest = hash_token(token)
        held = sum(1 for owner in self._owners().values() if _digest(owner) == digest)
        if held >= MAX_SESSIONS_PER_TOKEN:
            raise RateLimited(
                f"this token has {MAX_SESSIONS_PER_TOKEN} open MCP sessions; end one "
                "(DELETE /mcp) or let one idle out"
            )

    def close_revoked(self) -> None:
        """Close every session whose token value is no longer in the token file (called when
        it reloads): forgotten at once (its id answers 404, it no longer counts), its
        transport terminated beside, which cancels its calls."""
        self._reloaded.set()  # the next expiry may have moved
        manager = self.manager
        for session_id, owner in list(self._owners().items()):
            if self.tokens.holds_value(_digest(owner)):
                continue
            # The manager's own tables (mcp 2.3.0): it offers no public way to end a session.
            manager._session_owners.pop(session_id, None)
            transport = manager._server_instances.pop(session_id, None)
            if transport is not None and self.closing is not None:
                self.closing.start_soon(_terminate, transport)

    async def close_when_values_expire(self, scope: anyio.CancelScope) -> None:
        """Close a value's sessions as soon as it stops being valid by the clock (a rotated
        token's old value at the end of its overlap, an expired token), with or without a
        request to make the token store look: it looks at each such moment (planned anew at
        each reload), and every :data:`EXPIRY_LOOK_S` for a changed file no request read."""
        with scope:
            while True:
                due = self.tokens.next_expiry
                wait = EXPIRY_LOOK_S if due is None else due - time.time()
                with anyio.move_on_after(min(EXPIRY_LOOK_S, max(0.0, wait))):
                    await self._reloaded.wait()
                self._reloaded = anyio.Event()
                self.tokens.refresh()

    def _owners(self) -> dict[str, str]:
        return {
            session_id: str(owner["client_id"])
            for session_id, owner in self.manager._session_owners.items()
        }


def _digest(owner: str) -> str:
    return owner.rpartition(OWNER_SEPARATOR)[2]


async def _terminate(transport: StreamableHTTPServerTransport) -> None:
    await shielded(transport.terminate())
