"""The request body's bound, enforced while it is read (a plain ASGI middleware).

A Content-Length above the bound is answered 413 at once, before a byte of the body is read; a
body without one (chunked) is counted as it arrives and answered 413 the moment it passes the
bound. Nothing is buffered beyond what the handler reads itself; once the 413 is sent, uvicorn
reads and drops the rest of the body, so the client sees the answer and the connection lives.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpu_service.api.errors import ApiError


def too_large(limit: int, size: int | None = None) -> ApiError:
    said = f"({size} bytes) " if size is not None else ""
    return ApiError(
        413,
        f"the request body {said}is larger than this server's limit of {limit} bytes "
        "(--max-request-bytes)",
        code="request_too_large",
    )


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes, int(declared)).response()(scope, receive, send)
            return
        num_read = 0

        async def receive_bounded() -> Message:
            nonlocal num_read
            message = await receive()
            if message["type"] == "http.request":
                num_read += len(message.get("body", b""))
                if num_read > self.max_bytes:
                    raise too_large(self.max_bytes)  # the app's ApiError handler answers it
            return message

        await self.app(scope, receive_bounded, send)
