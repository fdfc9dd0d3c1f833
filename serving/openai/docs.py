"""/openapi.json and /docs: the schema (schema.py) and Swagger UI over it, with nothing fetched
from the internet: the page loads Swagger UI's script and style from /docs/, served from the
files of the swagger-ui-bundle-v2 package (Swagger UI 5, which reads OpenAPI 3.1).

    GET /openapi.json         the schema (with API keys: their bearer scheme, for "Authorize")
    GET /docs                 the page: swagger-ui.css, swagger-ui-bundle.js, then SwaggerUIBundle
                              pointed at /openapi.json
    GET /docs/<asset>         those two files, nothing else from the package
All three are open (no API key), as vLLM's are: a browser opening the page sends none.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from serving.openai.errors import not_found_route
from serving.openai.schema import openapi_schema

ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript"}

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>{title}</title>
  <link rel="stylesheet" href="/docs/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
                                 persistAuthorization: true}});
  </script>
</body>
</html>
"""


def _assets_dir() -> Path:
    from swagger_ui_bundle import swagger_ui_path  # a dependency; imported when the page is asked for

    return Path(swagger_ui_path)


class Docs:
    def __init__(self, model_name: str, api_keys: bool, lora_updates: bool = False):
        self._schema = JSONResponse(openapi_schema(model_name, api_keys, lora_updates)).body  # written once

    async def schema(self, request: Request) -> Response:
        return Response(self._schema, media_type="application/json")

    async def page(self, request: Request) -> Response:
        return HTMLResponse(_PAGE.format(title="jaxinfer API: Swagger UI"))

    async def asset(self, request: Request) -> Response:
        name = request.path_params["asset"]
        if name not in ASSETS:
            raise not_found_route(request.url.path)
        return FileResponse(_assets_dir() / name, media_type=ASSETS[name])
