"""What the running app holds: settings, tokens, catalog, store, providers, service, and the
jobs folder the catalog reloads from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.datastructures import State
from starlette.requests import Request

from relay.auth import TokenStore
from relay.http.run_stream import LiveRuns
from relay.providers.contract import Provider
from relay.runs.catalog import Catalog
from relay.runs.event_bus import EventBus
from relay.runs.jobs_folder import JobsFolder
from relay.runs.reaper import Reaper
from relay.runs.service import RunService
from relay.runtime import Relay
from relay.settings import Settings
from relay.store.database import Store


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
    jobs: JobsFolder | None = None

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
            jobs=relay.jobs,
        )

    def base_url(self, request: Request) -> str:
        """The start of the relay's URLs in answers (a run's ``Location``):
        ``RELAY_PUBLIC_URL``, else none, so the URL is relative (RFC 9110 allows it) under
        the server's root path. Never the request's ``Host``: the caller sends it, and a
        URL built from it points wherever the caller (or whoever rewrote the request)
        chose, and is cached or followed as the relay's."""
        if self.settings.public_url:
            return self.settings.public_url.rstrip("/")
        root_path: str = request.scope.get("root_path", "")
        return root_path.rstrip("/")


class PlainState(State):
    """Starlette's ``app.state`` with each value also a plain attribute. Starlette's ``State``
    keeps them in a dict and finds one in its ``__getattr__``, which Python calls only after
    its own look-up failed and raised an ``AttributeError``: ``request.app.state.relay``
    cost 0.8-1.2 us (``timeit``), and every request looks it up. Set and deleted as an attribute
    or an item, a value is kept in both places, so either way reads it."""

    def __setattr__(self, key: Any, value: Any) -> None:
        super().__setattr__(key, value)
        object.__setattr__(self, key, value)

    def __delattr__(self, key: Any) -> None:
        super().__delattr__(key)
        object.__delattr__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self.__setattr__(key, value)

    def __delitem__(self, key: str) -> None:
        self.__delattr__(key)
