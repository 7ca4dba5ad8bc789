"""create_app(settings) → the Starlette app; errors are mapped to JSON here, once.

The lifespan enters the relay's runtime (relay/runtime.py: the store, providers, run
service, reaper, dispatcher and pruner, started at once beside serving, ended in order on
shutdown) and serves the app's own parts beside it: metrics, live run streams, ``/mcp``.
Token file and job catalog are read before the app exists, so a bad one stops startup; the
catalog reloads later (relay/runs/jobs_folder.py), and ``/mcp`` follows it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay import logs
from relay.auth import TokenStore
from relay.errors import (
    BodyTooLarge,
    MethodNotAllowed,
    NotFound,
    RelayError,
    StoreUnavailable,
)
from relay.http.access_log import report
from relay.http.app_state import AppState, PlainState
from relay.http.console_page import console_routes
from relay.http.docs_page import docs_routes
from relay.http.index_page import index_routes
from relay.http.mcp_loader import McpLoader
from relay.http.metrics import Metrics
from relay.http.operator import operator_routes
from relay.http.routes import CREATE_RUN, create_run, routes
from relay.http.run_stream import LiveRuns
from relay.providers.contract import Provider
from relay.runs.catalog import Catalog
from relay.runs.models import ErrorBody, ErrorDetail
from relay.runtime import Relay, check_start
from relay.settings import Settings
from relay.store.database import STORE_FAILURES, is_store_failure

log = logging.getLogger("relay.app")


def error_response(request: Request, error: RelayError) -> Response:
    detail = ErrorDetail(
        code=error.code,
        message=error.message,
        request_id=getattr(request.state, "request_id", ""),
        run_id=error.details.get("run_id"),
        fields=error.details.get("fields"),
    )
    return Response(
        ErrorBody(error=detail).model_dump_json(exclude_none=True),
        status_code=error.status,
        headers=error.response_headers(),
        media_type="application/json",
    )


async def _relay_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RelayError)
    return error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        # Every method the path answers to (a path may be split over several routes).
        path = request.url.path
        methods = sorted(
            {m for r in request.app.routes if r.path_regex.match(path) for m in r.methods or ()}
        )
        return error_response(request, MethodNotAllowed(headers={"Allow": ", ".join(methods)}))
    return error_response(request, NotFound("no such route"))


STORE_RETRY_AFTER_S = 2.0
"""The ``Retry-After`` of a ``503 store_unavailable``."""


async def _store_error(request: Request, exc: Exception) -> Response:
    if not is_store_failure(exc):
        return await _unexpected(request, exc)
    log.warning("store unavailable", extra={"error_class": type(exc).__name__})
    return error_response(request, StoreUnavailable(retry_after=STORE_RETRY_AFTER_S))


def _store_refusal(exc: Exception) -> RelayError | None:
    """A store failure as an MCP tool answers it: ``store_unavailable``, like ``/v1``."""
    return StoreUnavailable(retry_after=STORE_RETRY_AFTER_S) if is_store_failure(exc) else None


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The body never came whole: the connection was closed (``RELAY_BODY_TIMEOUT_S``,
    relay/http/connections.py, or the caller left). Nobody reads this answer; the access log
    records it as 408, and it is no error of the relay's."""
    return Response(status_code=408)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error(
        "unhandled error",
        extra={"error_class": type(exc).__name__, "traceback": logs.traceback_of(exc)},
    )
    return error_response(request, RelayError())


Handler = Callable[[Request, Exception], Awaitable[Response]]
HANDLERS: dict[type[BaseException], Handler] = {
    RelayError: _relay_error,
    HTTPException: _http_error,
    **dict.fromkeys(STORE_FAILURES, _store_error),
    ClientDisconnect: _client_gone,
}
"""What an error raised in a handler answers (Starlette's exception middleware, and
:meth:`RequestContext.create_run`); any other error is :func:`_unexpected`'s ``500``."""


def _handler_of(error: Exception) -> Handler | None:
    """The handler of ``error``'s nearest class in :data:`HANDLERS` (as Starlette looks)."""
    for kind in type(error).__mro__:
        handler = HANDLERS.get(kind)
        if handler is not None:
            return handler
    return None


OUTPUT_PATHS = ("/v1/", "/mcp")
"""Answers that carry a job's output (runs, their list and events, /mcp tool results)."""


def _no_store(headers: list[tuple[bytes, bytes]], path: str) -> list[tuple[bytes, bytes]]:
    """``Cache-Control: no-store`` on every answer that names no caching of its own, and on
    every answer under :data:`OUTPUT_PATHS` whatever it named: no cache between the caller
    and the relay may keep a job's output. (The MCP SDK's event streams say ``no-cache``,
    which lets a cache store them; its ``no-transform`` is kept.) ``headers`` is the
    caller's own list: the field is added to it."""
    own = None
    for name, value in headers:
        if name.lower() == b"cache-control":
            own = value  # the first one
            break
    if own is None:
        headers.append(_NO_STORE)
        return headers
    if b"no-store" in own or not path.startswith(OUTPUT_PATHS):
        return headers
    kept = [(name, value) for name, value in headers if name.lower() != b"cache-control"]
    transform = b", no-transform" if b"no-transform" in own else b""
    return [*kept, (b"cache-control", b"no-store" + transform)]


_NO_STORE = (b"cache-control", b"no-store")


class RequestIds:
    """Request ids: ``req_`` and 16 hex digits of the OS's random source, drawn 1 KiB at a
    time. ``secrets.token_hex(8)`` asks the kernel for 8 bytes on every request (a syscall:
    1.3-2.4 us against 0.2-0.5 for an id from the pool, ``timeit``). Taking an id is one
    ``list.pop``, so two threads serving one app never take the same one; a forked child
    draws its own."""

    __slots__ = ("_ids",)
    POOL_BYTES = 1024

    def __init__(self) -> None:
        self._ids: list[str] = []
        os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:
        """Drop the ids drawn but not taken (a forked child must not take its parent's)."""
        self._ids = []

    def new(self) -> str:
        try:
            return self._ids.pop()
        except IndexError:
            digits = os.urandom(self.POOL_BYTES).hex()
            self._ids = [f"req_{digits[at : at + 16]}" for at in range(0, len(digits), 16)]
            return self._ids.pop()


REQUEST_IDS = RequestIds()


class RequestContext:
    """The outermost of the relay's own middleware, as raw ASGI: each request starts with
    fresh log ids and a request id (a sane ``X-Request-Id`` is honoured), its body is held
    to the size limit, every answer is ``Cache-Control: no-store`` unless it says
    otherwise, and its line and metrics sample are written as it ends
    (relay/http/access_log.py), whatever it answered.

    The limit is enforced while the body streams in, so an oversized body is refused
    with 413 before it is read whole.

    ``POST /v1/runs``, the request every run comes by, is served here (:meth:`create_run`)
    rather than through Starlette's exception middleware, router and route, which each
    wrap the request again for a path and method known at once; and :class:`RelayApp` hands
    it here directly (``outermost``), not through Starlette's error middleware, whose part
    this plays for it: an error no handler answers is answered by :func:`_unexpected`'s
    ``500`` (unless the answer had started) and raised again, after the request's line, as
    that middleware does around every other request.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, *, outermost: bool = False
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = logs.fresh_context()
        started = time.perf_counter()
        status = 500  # what the error middleware answers if nothing else did
        answering = False  # the answer's head went out
        headers = dict(scope["headers"])
        incoming = headers.get(b"x-request-id")  # most requests send none: nothing to decode
        request_id = ""
        # ASCII only: the id goes back in the answer's header as UTF-8, and any other
        # byte would come back as two, not the caller's own.
        if incoming is not None and 0 < len(incoming) <= 128 and incoming.isascii():
            text = incoming.decode("ascii")
            if text.isprintable():
                request_id = text
        request_id = request_id or REQUEST_IDS.new()
        scope.setdefault("state", {})["request_id"] = request_id
        logs.bind(request_id=request_id)
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        too_large = False
        if length is not None:
            try:
                too_large = int(length) > limit
            except ValueError:
                too_large = True
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(f"the body is over {limit} bytes")
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, answering
            if message["type"] == "http.response.start":
                status = message["status"]
                answering = True
                sent = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                # A handler's headers for whatever it answers, an error included (the
                # RateLimit fields of POST /v1/runs); the answer's own win.
                extra: dict[str, str] = scope["state"].get("extra_headers") or {}
                if extra:
                    names = {name.lower() for name, _ in sent}
                    sent += [
                        (name.lower().encode(), value.encode())
                        for name, value in extra.items()
                        if name.lower().encode() not in names
                    ]
                message["headers"] = _no_store(sent, scope["path"])
            await send(message)

        crash: Exception | None = None
        try:
            if too_large:
                request = Request(scope)
                response = error_response(request, BodyTooLarge(f"the body is over {limit} bytes"))
                response.headers["Connection"] = "close"
                await response(scope, receive, send_with_id)
            elif (
                scope["path"] == "/v1/runs"
                and scope["method"] == "POST"
                and not scope.get("root_path")
            ):
                # The headers by name serve the run's request as they are, unless a name
                # came twice (the request reads each name's first value, this its last).
                first = headers if len(headers) == len(scope["headers"]) else None
                await self.create_run(scope, limited_receive, send_with_id, first)
            else:
                await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:
            if not outermost:
                raise
            crash = exc
        finally:
            report(self.metrics, scope, status, time.perf_counter() - started)
            logs.restore(context)
        if crash is not None:  # as Starlette's error middleware does, outside the context
            response = await _unexpected(Request(scope), crash)
            if not answering:
                await response(scope, receive, send)
            raise crash

    @staticmethod
    async def create_run(
        scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes] | None = None
    ) -> None:
        """``POST /v1/runs`` as the router, the route and the exception middleware serve it:
        the same scope keys, the same handler for the same error, the same answer. (Their
        check that no handled error comes once the answer started has nothing to catch
        here: the answer is a plain ``Response``, whose sending raises none of them.)"""
        scope["router"] = scope["app"].router
        scope["route"] = CREATE_RUN
        scope["endpoint"] = create_run
        scope["path_params"] = {}
        request = Request(scope, receive, send)
        try:
            response = await create_run(request, headers)
        except Exception as exc:
            handler = _handler_of(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None  # a reused exception would gather tracebacks
        await response(scope, receive, send)


class RelayApp(Starlette):
    """Starlette's app, handing ``POST /v1/runs`` (every run's request) to its
    :class:`RequestContext` directly: Starlette's error middleware, outermost, would wrap the
    request and each message of its answer once more for what the context does for it
    (:meth:`RequestContext.__call__`, ``outermost``). Every other request goes Starlette's
    way."""

    context: RequestContext | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        inner = getattr(stack, "app", None)  # the error middleware's: the first user middleware
        self.context = inner if isinstance(inner, RequestContext) else None
        return stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        context = self.context
        if (
            context is not None
            and scope["type"] == "http"
            and scope["path"] == "/v1/runs"
            and scope["method"] == "POST"
            and not scope.get("root_path")
        ):
            await context(scope, receive, send, outermost=True)
        else:
            await self.middleware_stack(scope, receive, send)


def create_app(
    settings: Settings,
    *,
    instance_id: str | None = None,
    providers: dict[str, Provider] | None = None,
) -> RelayApp:
    """The relay app; raises ConfigError at once for a bad token file or job manifest.

    ``providers`` are ones already built (``relay serve`` builds them before serving, to
    stop on a missing SDK or key in one line); else the lifespan builds them. Either way
    the lifespan closes them."""
    tokens = TokenStore(settings.tokens_file)
    exposed = tokens.exposed_secrets()
    if exposed is not None:
        log.warning(exposed)
    catalog = Catalog.load(settings.jobs_dir)
    check_start(settings, catalog)
    metrics_token = settings.metrics_token
    metrics = Metrics(metrics_token.get_secret_value() if metrics_token else None)
    logs.redact_settings(settings)  # a key that still reaches a log line reads [redacted]
    # /mcp: a fresh SDK server per app, built at its first request; its sessions per lifespan
    mcp = McpLoader(catalog, tokens, settings, refusal_of=_store_refusal)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        opened = Relay.open(
            settings, tokens=tokens, catalog=catalog, providers=providers, instance_id=instance_id
        )
        async with opened as relay:
            metrics.follow(relay)
            relay.jobs.follow(mcp.tools_changed)  # open sessions re-list their tools
            app.state.relay = state = AppState.of(relay)
            state.live = live = LiveRuns(
                relay.events, max_streams_per_token=settings.max_streams_per_token
            )
            # Closed after the runs drain, the MCP sessions first (relay/runtime.py).
            await relay.start(contextlib.closing(live), mcp.running())
            yield {}

    app = RelayApp(
        routes=[
            *index_routes,
            *routes,
            *operator_routes,
            *docs_routes,
            *console_routes,
            Route("/mcp", mcp),
        ],
        lifespan=lifespan,
        exception_handlers={**HANDLERS, Exception: _unexpected},
    )
    app.state = PlainState()
    app.add_middleware(RequestContext, max_body_bytes=settings.max_body_bytes, metrics=metrics)
    app.state.metrics = metrics
    return app
