"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with a status;
under /v1/messages in Anthropic's: {"type": "error", "error": {"type", "message"}}.

Engine errors (engine/errors.py) become ApiErrors only through ENGINE_ERRORS, wherever they
surface: a request add_request refused, a non-streamed request or a stream whose first event
ends it with an error (the response's status), and a stream that fails later (its error event).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from gpu_service.engine.errors import (
    DeadlineExceeded,
    EngineError,
    EngineStopped,
    ExpertsUnavailable,
    InvalidPrompt,
    InvalidRequest,
    PromptTooLong,
    RequestAborted,
)

log = logging.getLogger("ktserve.api")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATHS = "/v1/messages"

# NOTE: looked up along the error's MRO: the most derived class listed wins.
ENGINE_ERRORS: dict[type[EngineError], tuple[int, str | None]] = {  # -> (status, code)
    PromptTooLong: (400, "context_length_exceeded"),
    InvalidRequest: (400, None),
    EngineStopped: (503, "shutting_down"),
    RequestAborted: (503, "aborted"),
    DeadlineExceeded: (504, "deadline_exceeded"),
    ExpertsUnavailable: (503, "experts_unavailable"),
    EngineError: (500, None),
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API of `path` writes errors."""
        anthropic = path.startswith(ANTHROPIC_PATHS)
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_engine(exc: EngineError, prompt_param: str | None = None) -> ApiError:
    """The ApiError of an engine error; prompt_param names the field of a bad prompt."""
    status, code = next(ENGINE_ERRORS[c] for c in type(exc).__mro__ if c in ENGINE_ERRORS)
    param = prompt_param if isinstance(exc, InvalidPrompt) else None
    return ApiError(status, str(exc), param=param, code=code)


def from_validation(exc: ValidationError | RequestValidationError) -> ApiError:
    """The first problem pydantic found, named by its field path (messages.0.content)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # NOTE: unions report one error per member type; the path up to the member is the field.
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}")
    return invalid(f"{param}: {message}" if param else message, param=param)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict", "none"} or "[" in part


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        return ApiError(exc.status_code, message).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        return error.response(request.url.path)
