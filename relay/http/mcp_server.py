"""``/mcp``: the relay as a remote MCP server (Streamable HTTP, the official ``mcp`` SDK).

A token sees one tool per job it may run, ``run_command`` if it has the command scope,
and ``get_run``. A tool call is a ``POST /v1/runs`` by other means: the same request
model, the same run service (scopes, params, limits, idempotency, cost, the store), so
the run shows in ``GET /v1/runs`` and ``/metrics`` like any other. While it runs, its
output goes out as progress notifications (and a route's failover as one, "e2b: create
timed out after 10 s; trying daytona"); a client that cancels the call cancels the
run (its sandbox is terminated); a run still going after ``RELAY_MAX_WAIT_S`` is answered
with its id and state, for ``get_run`` to read later. A refusal (bad arguments, a limit, a
job this token may not run, an unknown run) is a tool error whose text is ``code: message``.

When the jobs reload, the next ``tools/list`` shows the new catalog. A 2025-era session that
has listed its tools is sent ``notifications/tools/list_changed`` on its standalone stream (its
GET), and the server says so (``tools.listChanged``); a 2026-era client holds no session and
is told nothing (``subscriptions/listen`` is not served), so it sees the change when it lists.

Sessions are stateful (the SDK's default, with SSE answers): the only mode in which both
progress and a client's cancellation reach the tool in both protocol eras (the 2025
handshake clients most connectors speak, and 2026-07-28). The cost is process-local
sessions, so replicas behind one host need a balancer that keeps a client on one replica
(2026-era requests carry no session and go anywhere). Auth is the relay's own, per request: the
Origin and the token of every request are checked before the SDK sees it, and the SDK pins a
session to the token value that opened it (mcp_sessions.py: the Origin rule, the per-value cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import mcp.types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.authentication import AuthCredentials
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from relay import __version__
from relay.auth import Principal, TokenStore
from relay.cancellation import shielded
from relay.errors import InvalidRequest, RelayError
from relay.http.app_state import AppState
from relay.http.mcp_sessions import SessionOwners, check_origin
from relay.http.mcp_tools import (
    COMMAND_DESCRIPTION,
    COMMAND_SCHEMA,
    GET_RUN_DESCRIPTION,
    GET_RUN_SCHEMA,
    RUN_OUTPUT_SCHEMA,
    input_schema,
    job_schema,
    run_request,
    tool_names,
    unlisted_refusal,
)
from relay.http.routes import authenticate, presented_token
from relay.run_state import RunState
from relay.runs.catalog import COMMAND_TOOL, GET_RUN_TOOL, Catalog
from relay.runs.models import RunRequest
from relay.runs.service import RunRecord
from relay.runs.view import artifact_models, run_model

log = logging.getLogger("relay.mcp")

PRINCIPAL_KEY = "relay.principal"
"""Where the authenticated caller waits in the ASGI scope for the tool handlers."""
CHECK_S = 1.0
"""How often a call silent meanwhile looks whether its run ended without telling it."""
CANCEL_S = 30.0
"""Longest wait for a canceled call's run to be stopped."""
NOTIFY_S = 2.0
"""Longest wait for one session's ``tools/list_changed`` to go out."""


class McpEndpoint:
    """The MCP server, its session manager, and the authenticating ASGI endpoint."""

    def __init__(
        self,
        catalog: Catalog,
        tokens: TokenStore,
        *,
        allowed_origins: frozenset[str],
        refusal_of: Callable[[Exception], RelayError | None] = lambda exc: None,
    ) -> None:
        self.catalog = catalog
        self.allowed_origins = allowed_origins
        # What a failure (the store away) answers on /v1 too; None: an internal error.
        self.refusal_of = refusal_of
        self._listing: dict[str, ServerSession] = {}
        """The 2025-era sessions that listed their tools, by id: told when the jobs reload."""
        self.server: Server[Any] = _Server(
            "relay",
            version=__version__,
            instructions="Each tool runs one of this relay's jobs in a fresh sandbox.",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            # Schemas depend on the tool alone; who may call it is decided per call.
            get_tool_input_schema=lambda name: input_schema(name, catalog),
        )
        self.manager = StreamableHTTPSessionManager(app=self.server)
        self.transport = StreamableHTTPASGIApp(self.manager)
        self.owners = SessionOwners(self.manager, tokens)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The sessions' task group: entered once, for the app's lifetime."""
        async with self.manager.run(), anyio.create_task_group() as closing:
            self.owners.closing = closing
            watching = anyio.CancelScope()
            closing.start_soon(self.owners.close_when_values_expire, watching)
            try:
                yield
            finally:
                watching.cancel()
                self.owners.closing = None

    async def tools_changed(self, catalog: Catalog) -> None:
        """Tell each open session that has listed its tools that the list changed (the jobs
        reloaded), at most :data:`NOTIFY_S` each, all at once; a session gone is skipped."""
        # The manager's own table (mcp 2.3.0): it offers no public list of open sessions.
        open_sessions = self.manager._server_instances
        self._listing = {key: one for key, one in self._listing.items() if key in open_sessions}
        async with anyio.create_task_group() as telling:
            for session in self._listing.values():
                telling.start_soon(_tell_tools_changed, session)

    def _note_listing(self, ctx: ServerRequestContext[Any]) -> None:
        request = ctx.request
        session_id = (
            request.headers.get(MCP_SESSION_ID_HEADER) if isinstance(request, Request) else None
        )
        if session_id is None or ctx.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
            return
        self._listing[session_id] = ctx.session
        if len(self._listing) > 2 * len(self.manager._server_instances) + 16:
            open_sessions = self.manager._server_instances
            self._listing = {key: one for key, one in self._listing.items() if key in open_sessions}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the Origin, authenticate like ``/v1`` (a RelayError becomes the usual JSON
        answer), then hand the request to the SDK."""
        request = Request(scope, receive)
        # Before anything else: a page elsewhere learns nothing, not even whether a token works.
        check_origin(request.headers.get("origin"), self.allowed_origins)
        principal = authenticate(request)  # a 401 carries its WWW-Authenticate challenge
        token = presented_token(request) or ""
        # What opens a session: a 2025-era POST without one (2026-era requests hold none).
        era = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        opening = (
            request.method == "POST"
            and MCP_SESSION_ID_HEADER not in request.headers
            and (era is None or era in HANDSHAKE_PROTOCOL_VERSIONS)
        )
        if opening:
            self.owners.refuse_past_cap(token)
        scope[PRINCIPAL_KEY] = principal
        scope["user"] = self.owners.user(principal, token)
        scope["auth"] = AuthCredentials([])
        await self.transport(scope, receive, send)

    # -- handlers ------------------------------------------------------------------------

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        principal, _ = _caller(ctx)
        self._note_listing(ctx)
        tools = []
        jobs = self.catalog.jobs  # one catalog for the whole list, whatever reloads
        for name in tool_names(principal, self.catalog):
            if name == COMMAND_TOOL:
                description, schema = COMMAND_DESCRIPTION, COMMAND_SCHEMA
            elif name == GET_RUN_TOOL:
                description, schema = GET_RUN_DESCRIPTION, GET_RUN_SCHEMA
            elif name in jobs:
                job = jobs[name]
                description, schema = job.description, job_schema(job)
            else:
                continue
            tools.append(
                types.Tool(
                    name=name,
                    description=description,
                    input_schema=schema,
                    output_schema=RUN_OUTPUT_SCHEMA,
                )
            )
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        principal, state = _caller(ctx)
        name, arguments = params.name, dict(params.arguments or {})
        if name not in tool_names(principal, self.catalog):
            forbidden = unlisted_refusal(name, principal)
            if forbidden is not None:  # a host's list from before the token lost the job
                return error_result(forbidden)
            raise MCPError(code=types.INVALID_PARAMS, message=f"unknown tool: {name!r}")
        try:
            if name == GET_RUN_TOOL:
                return await self._get_run(state, principal, arguments)
            request, key = run_request(name, arguments, self.catalog)
            run = await _admit(state, principal, request, key)
            return await self._follow(ctx, state, principal, run)
        except RelayError as error:
            return error_result(error)
        except Exception as exc:  # an answer never carries the relay's internals
            refusal = self.refusal_of(exc)
            if refusal is not None:
                log.warning(
                    "mcp tool refused", extra={"error_class": type(exc).__name__, "tool": name}
                )
                return error_result(refusal)
            log.error("mcp tool failed", extra={"error_class": type(exc).__name__, "tool": name})
            return error_result(RelayError())

    async def _get_run(
        self, state: AppState, principal: Principal, arguments: dict[str, Any]
    ) -> types.CallToolResult:
        run_id = arguments.get("run_id")
        if set(arguments) != {"run_id"} or not isinstance(run_id, str) or len(run_id) > 64:
            raise InvalidRequest("get_run takes one argument, run_id (a run's id)")
        run = await state.service.get(principal, run_id)
        return await _result(state, run)

    async def _follow(
        self, ctx: ServerRequestContext[Any], state: AppState, principal: Principal, run: RunRecord
    ) -> types.CallToolResult:
        """Wait for the run (``RELAY_MAX_WAIT_S`` at most), sending its output as progress;
        cancel it if the client cancels the call."""
        try:
            run = await _wait(ctx, state, principal, run)
        except anyio.get_cancelled_exc_class():
            await shielded(_cancel_run(state, principal, run.id))
            raise
        return await _result(state, run)


class _Server(Server[Any]):
    """The SDK's server, saying to 2025-era clients that its tool list can change."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )


async def _tell_tools_changed(session: ServerSession) -> None:
    with anyio.move_on_after(NOTIFY_S), contextlib.suppress(Exception):
        await session.send_tool_list_changed()  # to a client gone: nothing to tell


async def _admit(
    state: AppState, principal: Principal, request: RunRequest, key: str | None
) -> RunRecord:
    """Submit the call's run, to the end of its admission whatever cancels the call: a call
    cancelled meanwhile cancels its run then, rather than leave it started with nobody
    waiting for it."""
    admission = asyncio.ensure_future(state.service.submit(principal, request, key))
    try:
        run, _created = await shielded(admission)
    except asyncio.CancelledError:
        if not admission.cancelled() and admission.exception() is None:
            await shielded(_cancel_run(state, principal, admission.result()[0].id))
        raise
    return run


async def _cancel_run(state: AppState, principal: Principal, run_id: str) -> None:
    """Cancel the run of a cancelled call (awaited shielded; bounded by :data:`CANCEL_S`)."""
    with anyio.move_on_after(CANCEL_S):
        with contextlib.suppress(RelayError):  # ended meanwhile: run_finished
            await state.service.cancel(principal, run_id)
        log.info("mcp call canceled, run canceled", extra={"run_id": run_id})


def _caller(ctx: ServerRequestContext[Any]) -> tuple[Principal, AppState]:
    request = ctx.request
    if not isinstance(request, Request) or PRINCIPAL_KEY not in request.scope:
        # Every HTTP request passes McpEndpoint.__call__ first; nothing else reaches here.
        raise MCPError(code=types.INVALID_REQUEST, message="not authenticated")
    state: AppState = request.app.state.relay
    principal: Principal = request.scope[PRINCIPAL_KEY]
    return principal, state


async def _output(ctx: ServerRequestContext[Any], state: AppState, run_id: str) -> None:
    """Send the run's output as progress notifications until the run ends here."""
    service, live = state.service, state.live
    queue = live.follow(run_id, running_here=service.holds(run_id)) if live else None
    if live is None or queue is None:
        return
    sent = 0
    try:
        while True:
            try:
                line = await asyncio.wait_for(queue.get(), CHECK_S)
            except TimeoutError:
                # The end may never reach a buffer made as the run ended: ask the service.
                try:
                    found = await service.find(run_id)
                except Exception:
                    if service.holds(run_id):
                        continue  # the store is away: this run's end still comes from here
                    raise
                if found is None or RunState(found.state).final:
                    return
                continue
            if line is None:
                return
            if line.get("event") == "attempt":
                # A route moved the run on ("e2b: create timed out after 10 s; trying
                # daytona"): one step of progress, as progress must grow with each message.
                sent += 1
                await ctx.session.report_progress(sent, None, str(line["message"]))
                continue
            if line.get("event") != "output":
                continue
            text: str = line["text"]
            sent += len(text.encode("utf-8"))
            message = text if line.get("stream") == "stdout" else f"[stderr] {text}"
            await ctx.session.report_progress(sent, None, message)
    finally:
        live.unfollow(run_id, queue)


async def _wait(
    ctx: ServerRequestContext[Any], state: AppState, principal: Principal, run: RunRecord
) -> RunRecord:
    if RunState(run.state).final:
        return run
    service = state.service
    with anyio.move_on_after(state.settings.max_wait_s):
        await _output(ctx, state, run.id)
        return await service.wait(run.id, state.settings.max_wait_s)
    # Still running: the output so far, and its id for get_run.
    return await service.get(principal, run.id)


EMBED_TEXT_BYTES = 4096
"""A text artifact up to this size is embedded in a tool result; a larger one, or any other,
is a resource link (its download URL) the client fetches with its token."""


async def _result(state: AppState, run: RunRecord) -> types.CallToolResult:
    found = await state.service.deliveries([run])
    result = run_result(run, found.get(run.id), state.settings.public_url or "")
    for entry in artifact_models(run.id, run.artifacts):
        small = entry.size <= EMBED_TEXT_BYTES and _textual(entry.content_type)
        if entry.sha256 is None or not small:
            continue
        data = b"".join([chunk async for chunk in state.service.artifact_chunks_of(entry.sha256)])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        uri = (state.settings.public_url or "").rstrip("/") + (entry.url or "")
        resource = types.TextResourceContents(uri=uri, mime_type=entry.content_type, text=text)
        result.content.append(types.EmbeddedResource(resource=resource))
    return result


def _textual(content_type: str) -> bool:
    return content_type.startswith("text/") or content_type == "application/json"


def run_result(
    run: RunRecord, deliveries: Any = None, public_url: str = ""
) -> types.CallToolResult:
    """A run as a tool result: stdout as text, each kept artifact as a resource link (its
    download URL, under ``RELAY_PUBLIC_URL`` when set, else relative), the whole Run as
    structured content; any final state but ``succeeded`` is an error result."""
    answer = run_model(run, deliveries)
    content: list[types.ContentBlock] = [types.TextContent(text=answer.stdout)]
    for entry in answer.artifacts:
        if entry.url is not None:
            link = types.ResourceLink(
                name=entry.name,
                uri=public_url.rstrip("/") + entry.url,
                mime_type=entry.content_type,
                size=entry.size,
            )
            content.append(link)
    failed = False
    if not answer.state.final:
        content.append(
            types.TextContent(
                text=f"run {answer.id} is still {answer.state.value}: call get_run with "
                f'{{"run_id": "{answer.id}"}} to read it later'
            )
        )
    elif answer.state != RunState.succeeded:
        failed = True
        summary = f"run {answer.id} {answer.state.value}"
        if answer.exit_code is not None:
            summary += f" with exit code {answer.exit_code}"
        if answer.error is not None:
            summary += f": {answer.error.code}: {answer.error.message}"
        content.append(types.TextContent(text=summary))
    return types.CallToolResult(
        content=list(content),
        structured_content=answer.model_dump(mode="json"),
        is_error=failed,
    )


def error_result(error: RelayError) -> types.CallToolResult:
    """A refused call as a tool error the model reads: ``code: message`` as the HTTP API
    words it (and the retry hint, the run, the other fields at fault). No structured content:
    a tool's ``outputSchema`` is the Run, and a client checks structured content against it
    even on errors (the TypeScript SDK's does), so a refusal carries text alone."""
    text = f"{error.code}: {error.message}"
    if error.retry_after is not None:
        text += f" (retry after {max(1, round(error.retry_after))} s)"
    run_id = error.details.get("run_id")
    if isinstance(run_id, str):
        text += f" (run {run_id})"
    fields = error.details.get("fields")
    if isinstance(fields, list) and len(fields) > 1:
        text += "; also " + "; ".join(f"{f['field']}: {f['message']}" for f in fields[1:])
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)
