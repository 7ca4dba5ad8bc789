"""``GET /``: where to go from here, for whoever opens the relay's address.

A browser (``Accept`` naming ``text/html`` before JSON) gets a small page of links; anyone
else a small JSON object. Both point at ``/docs``, ``/openapi.json``, ``/console``,
``/healthz`` and ``/readyz``, under ``RELAY_PUBLIC_URL`` or the server's root path, and say
nothing ``/healthz`` does not: no version, no job, no provider, no secret.
"""

from __future__ import annotations

import html

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from relay.http.routes import json_answer, state_of
from relay.runs.models import Index

PAGE_POLICY = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
"""The page runs no script, loads nothing and takes no style: plain links."""

LINKS = (
    ("docs", "/docs", "the API reference"),
    ("openapi", "/openapi.json", "the OpenAPI 3.1 document"),
    ("console", "/console", "the operator console (an admin token)"),
    ("healthz", "/healthz", "liveness"),
    ("readyz", "/readyz", "readiness"),
)


def wants_html(request: Request) -> bool:
    """Whether the caller asked for a page: ``text/html`` named, and before any JSON."""
    accepted = [
        part.split(";")[0].strip().lower() for part in request.headers.get("accept", "").split(",")
    ]
    if "text/html" not in accepted:
        return False
    json_at = (
        accepted.index("application/json") if "application/json" in accepted else len(accepted)
    )
    return accepted.index("text/html") < json_at


async def index(request: Request) -> Response:
    base = state_of(request).base_url(request)
    links = {name: base + path for name, path, _ in LINKS}
    vary = {"Vary": "Accept"}
    if not wants_html(request):
        return json_answer(Index(**links), headers=vary)
    items = "\n".join(
        f'<li><a href="{html.escape(links[name])}">{html.escape(path)}</a>: {text}</li>'
        for name, path, text in LINKS
    )
    page = (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<title>relay</title>\n"
        "</head>\n<body>\n<h1>relay</h1>\n"
        "<p>Runs declared jobs in short-lived sandboxes. Callers hold a token: "
        "<code>POST /v1/runs</code>.</p>\n"
        f"<ul>\n{items}\n</ul>\n</body>\n</html>\n"
    )
    headers = {**vary, "Content-Security-Policy": PAGE_POLICY, "X-Content-Type-Options": "nosniff"}
    return HTMLResponse(page, headers=headers)


index_routes = [Route("/", index, methods=["GET"])]
