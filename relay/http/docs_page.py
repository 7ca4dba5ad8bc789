"""``GET /docs``: an interactive reference of ``/openapi.json`` (Swagger UI), served whole.

The UI's files come from the ``swagger-ui-bundle-v2`` package, so nothing is fetched from
another host when the page is read; the page and its start script live in ``docs/`` beside
this module. Every answer carries a Content-Security-Policy that allows this origin only.
Like ``/openapi.json``, the page needs no token: the document holds no secrets. These
routes are not in the OpenAPI document, which describes the API, not this page.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route
from swagger_ui_bundle import swagger_ui_path

from relay.errors import NotFound

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""This origin only, no inline script or style: Swagger UI 5 renders whole under it."""

PAGE_FILES = Path(__file__).parent / "docs"
UI_FILES = Path(str(swagger_ui_path))

ASSETS = {
    "docs.js": PAGE_FILES / "docs.js",
    "swagger-ui-bundle.js": UI_FILES / "swagger-ui-bundle.js",
    "swagger-ui.css": UI_FILES / "swagger-ui.css",
    "favicon-32x32.png": UI_FILES / "favicon-32x32.png",
}
"""What the page loads, by the name it asks for; nothing else of the package is served."""

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def docs_page(request: Request) -> Response:
    return FileResponse(PAGE_FILES / "docs.html", headers=HEADERS, media_type="text/html")


async def docs_asset(request: Request) -> Response:
    path = ASSETS.get(request.path_params["name"])
    if path is None:
        raise NotFound("no such route")
    return FileResponse(path, headers=HEADERS)


docs_routes = [
    Route("/docs", docs_page, methods=["GET"]),
    Route("/docs/{name}", docs_asset, methods=["GET"]),
]
