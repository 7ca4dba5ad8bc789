"""One log line and one metrics sample per HTTP request, as raw ASGI middleware.

The line (event ``request``) carries method, route template, status, duration_ms,
request id and the token's *name* once authenticated; never a header, a query string or
a body. Health checks and scrapes log at debug level, so they don't drown the rest.
"""

from __future__ import annotations

import logging
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay import logs
from relay.http.metrics import UNMATCHED_ROUTE, Metrics

log = logging.getLogger("relay.access")

QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
_RUN_ID = re.compile(r"^run_[0-9a-f]{1,64}$")


class AccessLog:
    """Outermost middleware: starts each request with fresh log ids, then reports it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = logs.fresh_context()
        started = time.perf_counter()
        status = 500  # what the error middleware answers if nothing else did

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self._report(scope, status, time.perf_counter() - started)
            logs.restore(context)

    def _report(self, scope: Scope, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
        method = str(scope.get("method", ""))
        self.metrics.observe_request(method, route, status, seconds)
        state = scope.get("state") or {}
        run_id = (scope.get("path_params") or {}).get("run_id")
        level = logging.DEBUG if route in QUIET_ROUTES and status < 500 else logging.INFO
        log.log(
            level,
            "request",
            extra={
                "method": method if method.isalpha() and len(method) <= 16 else "other",
                "route": route,
                "status": status,
                "duration_ms": round(seconds * 1000, 1),
                "request_id": state.get("request_id"),
                "token": state.get("token_name"),
                "run_id": run_id if isinstance(run_id, str) and _RUN_ID.match(run_id) else None,
            },
        )
