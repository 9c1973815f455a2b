"""The FastAPI application: OpenAI-compatible /v1 routes; vLLM's /tokenize, /detokenize and
/version; /health (GET and HEAD) and /metrics.

Middlewares, outermost first: count (by route and status), API key (auth.py), early refusal (429
past the in-flight bound, 503 while draining: admission.py), the body read whole (413 past its
bound, 408 past its time: limits.py), admission (counts the request in, or 429 / 503)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpu_service.api import errors
from gpu_service.api.admission import AdmissionMiddleware, RefuseEarly
from gpu_service.api.auth import ApiKeyMiddleware, is_authorized
from gpu_service.api.chat import create_chat_completion
from gpu_service.api.completions import create_completion
from gpu_service.api.context import ApiContext
from gpu_service.api.generation import ClientGone
from gpu_service.api.limits import ReadBody
from gpu_service.api.tokenize import detokenize, tokenize
from ktserve.model_label import labeled_registry
from ktserve.version import ktserve_version

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
          "/tokenize", "/detokenize", "/version", "/health", "/metrics")  # fmt: skip


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(
        title="ktserve",
        description="OpenAI-compatible API of a ktserve server",
        docs_url=None,
        redoc_url=None,
    )
    app.state.ctx = ctx
    errors.install(app)
    http_registry = CollectorRegistry()
    requests_total = Counter(
        "ktserve_http_requests",
        "HTTP requests by route and status",
        ["route", "status"],
        registry=http_registry,
    )

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    def model_card() -> dict:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "ktserve",
            "root": ctx.model_name,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        ctx.check_model(model)
        return JSONResponse(model_card())

    @app.post("/tokenize")
    async def tokenize_(request: Request) -> Response:
        return await tokenize(request, ctx)

    @app.post("/detokenize")
    async def detokenize_(request: Request) -> Response:
        return await detokenize(request, ctx)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ktserve_version()})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> JSONResponse:
        """ok or not for anyone; the engine and the workers only with the API key."""
        workers = ctx.worker_status()
        engine = ctx.engine
        engine_alive = engine._thread is not None and engine._thread.is_alive()
        healthy = engine_alive and all(w["alive"] for w in workers)
        status = "ok" if healthy else "unavailable"
        if ctx.admission.draining:
            healthy, status = False, "shutting_down"
        if not is_authorized(request.headers.get("authorization"), ctx.api_key):
            return JSONResponse({"status": status}, status_code=200 if healthy else 503)
        body = {
            "status": status,
            "model": ctx.model_name,
            "engine": {
                "alive": engine_alive,
                "running": engine.num_running,
                "waiting": engine.num_waiting,
            },
            "workers": workers,
            "requests_in_flight": ctx.admission.in_flight,
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    exported = labeled_registry((*ctx.registries, http_registry), ctx.model_name)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exported), media_type=CONTENT_TYPE_LATEST)

    # NOTE: the last added runs first: requests are counted, refused ones (401, 429) included.
    app.add_middleware(AdmissionMiddleware, admission=ctx.admission)
    app.add_middleware(ReadBody, max_bytes=ctx.max_request_bytes,
                       read_timeout_s=ctx.request_read_timeout_s)  # fmt: skip
    app.add_middleware(RefuseEarly, admission=ctx.admission)
    if ctx.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=ctx.api_key,
                           metrics_public=ctx.metrics_public)  # fmt: skip
    app.add_middleware(_CountRequests, counter=requests_total)
    return app


class _CountRequests:
    """Counts requests by route and status (plain ASGI, so streams pass untouched)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        if path.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        status = {"code": 500}

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.counter.labels(route=route, status=str(status["code"])).inc()
