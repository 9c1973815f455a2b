"""The FastAPI application: OpenAI's /v1 routes (chat completions, completions, responses,
models), Anthropic's /v1/messages (and count_tokens); vLLM's /tokenize, /detokenize and /version;
/health and / (GET and HEAD) and /metrics.

Middlewares, outermost first: count and log (by method, route and status: access.py), API key
(auth.py), early refusal (429 past the in-flight bound, 503 while draining: admission.py), the
body read whole (413 past its bound, 408 past its time: limits.py), admission (counts the request
in, or 429 / 503)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.requests import ClientDisconnect, Request

from gpu_service.api import errors
from gpu_service.api.access import AccessMiddleware, RouteLabels
from gpu_service.api.admission import AdmissionMiddleware, RefuseEarly
from gpu_service.api.auth import ApiKeyMiddleware, is_authorized
from gpu_service.api.chat import create_chat_completion
from gpu_service.api.completions import create_completion
from gpu_service.api.context import ApiContext
from gpu_service.api.generation import ClientGone
from gpu_service.api.limits import ReadBody
from gpu_service.api.messages import count_message_tokens, create_message
from gpu_service.api.responses import ResponseStore, create_response, get_response
from gpu_service.api.tokenize import detokenize, tokenize
from ktserve.model_label import labeled_registry
from ktserve.version import ktserve_version

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{id}",
          "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/models/{model}",
          "/tokenize", "/detokenize", "/version", "/health", "/metrics", "/")  # fmt: skip


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
        "HTTP requests by method, route and status (a path no route answers: its first two "
        "segments, a bounded set of them)",
        ["method", "route", "status"],
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

    store = ResponseStore(ctx.max_stored_responses)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(request, ctx, store)

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str) -> Response:
        return get_response(store, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(request, ctx)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await count_message_tokens(request, ctx)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> JSONResponse:
        """For clients that check the base URL answers before they use it."""
        return JSONResponse({"status": "ok"})

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
    app.add_middleware(AccessMiddleware, counter=requests_total, labels=RouteLabels(ROUTES),
                       access_log=ctx.access_log)  # fmt: skip
    return app
