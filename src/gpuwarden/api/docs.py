"""``/docs``: the interactive page of the API (Swagger UI), served whole by the API.

FastAPI's own ``/docs`` loads Swagger UI from a CDN, so it is blank on a host
without the internet. Here the page's script, style sheet and icon come from
the ``fastapi-offline`` package installed with gpuwarden and are served by the
API itself under ``/docs/``; the page references nothing outside it (the
online validator is off), and its Content-Security-Policy lets a browser load
nothing from anywhere else. Like ``/openapi.json``, these need no token: they
say nothing that is not in the schema.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import FileResponse, HTMLResponse, Response

#: the page and its files, each name -> its media type
DOCS_URL = "/docs"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
#: a browser showing the page fetches nothing from elsewhere
CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)


def asset_dir() -> Path:
    """Where the installed Swagger UI files are (``fastapi_offline/static``)."""
    return Path(str(importlib.resources.files("fastapi_offline") / "static"))


def install(app: FastAPI) -> None:
    """Add ``/docs`` and its files (none is in the schema)."""
    folder = asset_dir()
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}

    @app.get(DOCS_URL, include_in_schema=False)
    def docs_page() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} {app.version} - API",
            swagger_js_url=f"{DOCS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )
        return HTMLResponse(page.body, headers=headers)

    for name, media in ASSETS.items():
        app.add_api_route(
            f"{DOCS_URL}/{name}",
            _file(folder / name, media, headers),
            methods=["GET"],
            include_in_schema=False,
        )


def _file(path: Path, media: str, headers: dict[str, str]) -> Callable[[], Response]:
    """A route that sends the one file ``path`` (it takes no parameter at all)."""

    def asset() -> Response:
        return FileResponse(path, media_type=media, headers=headers)

    return asset
