"""API keys: with one configured, every route needs the key, as `Authorization: Bearer <key>` or
as `x-api-key: <key>` (Anthropic's header), but the public ones: / and /health (which then says
only ok or not: no worker addresses or pids), and /metrics with --metrics-public. A plain ASGI
middleware, so streaming is left untouched."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gpu_service.api.errors import ApiError

HEALTH = "/health"
METRICS = "/metrics"
ROOT = "/"


def check_authorization(header: str | None, api_key: str) -> None:
    """Raise a 401 ApiError unless `header` is `Bearer <api_key>`."""
    scheme, _, token = (header or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401,
            "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


def is_authorized(header: str | None, api_key: str | None) -> bool:
    """Whether a request with this Authorization header may see everything (no key: anyone)."""
    if api_key is None:
        return True
    try:
        check_authorization(header, api_key)
    except ApiError:
        return False
    return True


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics_public: bool = False) -> None:
        self.app = app
        self.api_key = api_key
        self.public = {ROOT, HEALTH, METRICS} if metrics_public else {ROOT, HEALTH}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public:
            headers = Headers(scope=scope)
            sent = [headers.get("authorization")]
            if headers.get("x-api-key") is not None:
                sent.append(f"Bearer {headers['x-api-key']}")
            try:
                if not any(is_authorized(h, self.api_key) for h in sent if h is not None):
                    check_authorization(next((h for h in sent if h), None), self.api_key)
            except ApiError as exc:
                await exc.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
