"""``/mcp`` with the MCP SDK imported when the first request to it comes, not at start.

The SDK (with the types, OpenTelemetry and SSE packages it brings) is ~0.5 s of CPU to
import: more than a third of what a ``relay serve`` spends before it answers, paid by every
start, every replica and every test relay, whether anyone calls ``/mcp`` or not. So
:class:`McpLoader` stands at ``/mcp`` in its place: the first request to it has the endpoint
(relay/http/mcp_server.py) built, its SDK imported on a worker thread so the loop keeps
answering, and every request is then the endpoint's, unchanged.

The SDK's sessions live in a task group that the one task entering it must also leave, for
the app's whole lifetime: a request's task can do neither. :meth:`McpLoader.running` (entered
by the lifespan beside the runtime, as the endpoint's own was) starts a task that waits for
the first request, builds the endpoint, holds its ``running()`` until shutdown and leaves it
there, in the place the endpoint's own was left (the MCP sessions closed right after the
runs drain, relay/runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from relay.auth import TokenStore
from relay.errors import RelayError
from relay.runs.catalog import Catalog
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.http.mcp_server import McpEndpoint

log = logging.getLogger("relay.app")


class McpLoader:
    """The ``/mcp`` endpoint, built on its first request (see the module's docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        tokens: TokenStore,
        settings: Settings,
        *,
        refusal_of: Callable[[Exception], RelayError | None],
    ) -> None:
        def build() -> McpEndpoint:
            from relay.http.mcp_server import McpEndpoint
            from relay.http.mcp_sessions import own_origins

            origins = own_origins(settings)
            return McpEndpoint(catalog, tokens, allowed_origins=origins, refusal_of=refusal_of)

        self._build = build
        self.endpoint: McpEndpoint | None = None
        """The endpoint, once a request has asked for it."""
        self._wanted = asyncio.Event()
        self._ready = asyncio.Event()
        self._serving = False
        self._failure: BaseException | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The app's lifetime: the endpoint's sessions run, once built, until this ends."""
        # Made here, not with the app: an app may live through lifespans on several loops.
        self._wanted, self._ready, self._failure = asyncio.Event(), asyncio.Event(), None
        ending = asyncio.Event()
        holder = asyncio.create_task(self._hold(ending))
        self._serving = True
        try:
            yield
        finally:
            self._serving = False
            ending.set()
            await holder

    async def _hold(self, ending: asyncio.Event) -> None:
        """Build the endpoint on the first request, and hold its sessions' task group."""
        wanted = asyncio.ensure_future(self._wanted.wait())
        done = asyncio.ensure_future(ending.wait())
        await asyncio.wait((wanted, done), return_when=asyncio.FIRST_COMPLETED)
        wanted.cancel()
        if ending.is_set():
            done.cancel()
            self._ready.set()  # a request that came as the app ended: it finds no endpoint
            return
        try:
            # The import, off the loop (a module is imported once, whichever thread asks).
            await asyncio.to_thread(importlib.import_module, "relay.http.mcp_server")
            endpoint = self._build()
        except Exception as exc:  # an SDK that does not import: /mcp answers 500, /v1 serves on
            log.error("the MCP endpoint failed to load", extra={"error_class": type(exc).__name__})
            self._failure = exc
            self._ready.set()
            done.cancel()
            return
        try:
            async with endpoint.running():
                self.endpoint = endpoint
                self._ready.set()
                await done
        finally:
            self.endpoint = None
            self._ready.set()

    async def tools_changed(self, catalog: Catalog) -> None:
        """The endpoint's, once built (before, no session has listed any tools)."""
        if self.endpoint is not None:
            await self.endpoint.tools_changed(catalog)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoint
        if endpoint is None:
            endpoint = await self._load()
        await endpoint(scope, receive, send)

    async def _load(self) -> McpEndpoint:
        if not self._serving:
            # No lifespan (an app driven without one): the endpoint as it would be then,
            # its sessions never started, as before it was loaded late.
            self.endpoint = self.endpoint or self._build()
            return self.endpoint
        self._wanted.set()
        await self._ready.wait()
        if self.endpoint is None:
            raise RelayError("the MCP endpoint is not available") from self._failure
        return self.endpoint
