"""The HTTP face of the relay: the Starlette app and its wiring (app.py, app_state.py), the
thin handlers (routes.py), a run's live NDJSON stream (run_stream.py), ``/mcp`` (mcp_server.py,
mcp_tools.py: the jobs as MCP tools), the access log, the metrics endpoint, the OpenAPI
document, and the connection guard the server runs with (connections.py: header and body
deadlines, a connection cap).

A handler parses the request, asks the run service and writes the answer as JSON; errors are
mapped to JSON once, in app.py; the app's lifespan enters the runtime (relay/runtime.py),
which builds and ends everything below. This package may import every layer below it (the
runtime, webhooks, runs, providers, store, auth and the ground); nothing below imports it.
"""
