"""One log line and one metrics sample per HTTP request.

The line (event ``request``) carries method, route template, status, duration_ms,
request id and the token's *name* once authenticated; never a header, a query string or
a body. Health checks and scrapes log at debug level, so they don't drown the rest.
:class:`~relay.http.app.RequestContext` reports every request here as it ends.
"""

from __future__ import annotations

import logging
import re

from starlette.types import Scope

from relay.http.metrics import METHODS, UNMATCHED_ROUTE, Metrics

log = logging.getLogger("relay.access")

QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
_RUN_ID = re.compile(r"^run_[0-9a-f]{1,64}$")


def report(metrics: Metrics, scope: Scope, status: int, seconds: float) -> None:
    """Count the request in ``metrics`` and write its line."""
    route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
    method = str(scope.get("method", ""))
    metrics.observe_request(method, route, status, seconds)
    state = scope.get("state") or {}
    fields = {
        # The usual seven as they are, without the test for another one.
        "method": method
        if method in METHODS or (method.isalpha() and len(method) <= 16)
        else "other",
        "route": route,
        "status": status,
        "duration_ms": round(seconds * 1000, 1),
        "request_id": state.get("request_id"),
        "token": state.get("token_name"),
    }
    path_params = scope.get("path_params")
    if path_params:  # a route with a run id in its path; a None field is no field
        run_id = path_params.get("run_id")
        if isinstance(run_id, str) and _RUN_ID.match(run_id):
            fields["run_id"] = run_id
    if route in QUIET_ROUTES and status < 500:
        log.debug("request", extra=fields)
    else:
        log.info("request", extra=fields)  # the relay's loggers' quicker call (relay/logs.py)
