"""``/console``: the operator's pages (runs, one run, jobs, spend, health), served by the relay.

The pages are Jinja2 templates rendered here: the layout, navigation, filters and empty
tables. Their data comes from the JSON API alone, read by ``console.js`` with an admin
token the operator pastes once; the token stays in the tab's ``sessionStorage`` and goes
out as the auth header, never in a URL or a cookie. So a page holds no data until the
token is given, and the console can do nothing the API does not let that token do.

Every answer carries a strict Content-Security-Policy: this origin only, no inline script
or style. Data reaches the page through ``textContent`` and SVG attributes, never as HTML.
These routes, like ``/docs``, are not in the OpenAPI document.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from relay.errors import NotFound
from relay.run_state import FAILURES, RunState

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
"""This origin only: no inline script or style, no frames, forms post to the console;
images also from ``blob:`` (an artifact's preview, fetched with the token, never a URL)."""

FILES = Path(__file__).parent / "console"
ASSETS = {
    "console.js": FILES / "static" / "console.js",
    "console.css": FILES / "static" / "console.css",
    "favicon.svg": FILES / "static" / "favicon.svg",
}
"""What the pages load, by name; nothing else is served."""

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGES = {
    "runs": "Runs",
    "jobs": "Jobs",
    "spend": "Spend",
    "health": "Health",
}
RUN_ID = re.compile(r"^run_[0-9a-f]{1,40}$")

_templates = jinja2.Environment(
    loader=jinja2.FileSystemLoader(FILES / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def _page(request: Request, name: str, **context: object) -> Response:
    settings = request.app.state.relay.settings
    html = _templates.get_template(f"{name}.html").render(
        page=name,
        pages=PAGES,
        auth_header=settings.auth_header,
        **context,
    )
    return HTMLResponse(html, headers=HEADERS)


async def runs_page(request: Request) -> Response:
    return _page(request, "runs", states=_STATES, state_groups=_STATE_GROUPS)


async def run_page(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    if not RUN_ID.match(run_id):
        raise NotFound("no such run")
    return _page(request, "run", run_id=run_id)


async def jobs_page(request: Request) -> Response:
    return _page(request, "jobs", windows=_WINDOWS)


async def spend_page(request: Request) -> Response:
    return _page(request, "spend")


async def health_page(request: Request) -> Response:
    return _page(request, "health")


async def console_asset(request: Request) -> Response:
    path = ASSETS.get(request.path_params["name"])
    if path is None:
        raise NotFound("no such route")
    return FileResponse(path, headers=HEADERS)


_STATES = tuple(state.value for state in RunState)
_ENDED = tuple(state.value for state in RunState if state.final)
_STATE_GROUPS = {
    "every failure": tuple(state.value for state in FAILURES),
    "every end state": _ENDED,
    "active": tuple(state.value for state in RunState if not state.final),
}
"""The state filter's choices of several states (``GET /v1/runs?state=a,b``)."""
_WINDOWS = {1: "last hour", 24: "last 24 hours", 168: "last 7 days", 720: "last 30 days"}
"""The jobs page's windows, in hours (``GET /v1/outcomes?hours=``)."""

console_routes = [
    Route("/console", runs_page, methods=["GET"]),
    Route("/console/runs/{run_id}", run_page, methods=["GET"]),
    Route("/console/jobs", jobs_page, methods=["GET"]),
    Route("/console/spend", spend_page, methods=["GET"]),
    Route("/console/health", health_page, methods=["GET"]),
    Route("/console/static/{name}", console_asset, methods=["GET"]),
]
