"""API keys: with one configured, /v1/* needs `Authorization: Bearer <key>` (/health and /metrics
stay open for probes and scrapers). A plain ASGI middleware, so streaming is left untouched."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gpu_service.api.errors import ApiError

PROTECTED_PREFIX = "/v1"


def check_authorization(header: str | None, api_key: str) -> None:
    """Raise a 401 ApiError unless `header` is `Bearer <api_key>`."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401, "missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            try:
                check_authorization(Headers(scope=scope).get("authorization"), self.api_key)
            except ApiError as exc:
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
