"""What the running app holds: settings, tokens, catalog, store, providers, service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from relay.auth import TokenStore
from relay.http.run_stream import LiveRuns
from relay.providers.contract import Provider
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.runtime import Relay
from relay.settings import Settings
from relay.store.database import Store

MAX_BASE_URLS = 64
"""Ways of reaching the relay whose URL is remembered; a Host header is the caller's, so
past this many the oldest is forgotten (a caller sending many Hosts can't keep the relay's
usual one out for good, nor grow the cache)."""
MAX_REMEMBERED_HOST_CHARS = 255
"""A longer Host header (no host name is) is never remembered: its URL is built each time."""


@dataclass
class AppState:
    """Built by the app's lifespan; handlers reach it as ``request.app.state.relay``."""

    settings: Settings
    tokens: TokenStore
    catalog: Catalog
    store: Store
    providers: dict[str, Provider]
    service: RunService
    reaper: Reaper | None = None
    events: EventBus | None = None
    live: LiveRuns | None = None
    _base_urls: dict[tuple[Any, ...], str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, relay: Relay) -> AppState:
        """What handlers reach of a running relay (relay/runtime.py)."""
        return cls(
            relay.settings,
            relay.tokens,
            relay.catalog,
            relay.store,
            relay.providers,
            relay.service,
            relay.reaper,
            relay.events,
        )

    def base_url(self, request: Request) -> str:
        """The relay's URL: ``RELAY_PUBLIC_URL``, else as this request reached it."""
        if self.settings.public_url:
            return self.settings.public_url.rstrip("/")
        scope = request.scope
        # Built once per way the relay is reached (a few): URL parsing is not free, and
        # every run's answer carries it in its Location.
        host = request.headers.get("host")
        key = (
            scope.get("scheme"),
            repr(scope.get("server")),  # a tuple from uvicorn, a list from some servers
            scope.get("root_path", ""),
            host,
        )
        found = self._base_urls.get(key)
        if found is None:
            found = str(request.base_url).rstrip("/")
            if host is None or len(host) <= MAX_REMEMBERED_HOST_CHARS:
                if len(self._base_urls) >= MAX_BASE_URLS:
                    del self._base_urls[next(iter(self._base_urls))]
                self._base_urls[key] = found
        return found
