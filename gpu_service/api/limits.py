"""The request body, read whole before the handler runs, within two bounds (a plain ASGI
middleware).

Size: a Content-Length above --max-request-bytes is answered 413 at once, before a byte of the
body is read; a body without one (chunked) is counted as it arrives and answered 413 the moment
it passes the bound. Time: the whole body must arrive within --request-read-timeout of the
request's headers, else 408 and the connection is closed, so a client that uploads slowly (or
not at all) holds a connection for that long at most, and never an admission slot (admission.py
counts a request only once this is done). The handler then receives the body as one message;
later receive() calls (a stream watching for the client's disconnect) go to the connection.
"""

from __future__ import annotations

import asyncio

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


def too_slow(timeout_s: float, num_read: int) -> ApiError:
    return ApiError(
        408,
        f"the request body did not arrive within {timeout_s:g} s (--request-read-timeout; "
        f"{num_read} bytes came)",
        code="request_timeout",
        headers={"Connection": "close"},
    )


class ReadBody:
    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes, int(declared)).response(scope["path"])(
                scope, receive, send
            )
            return
        chunks: list[bytes] = []
        num_read, more = 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                refused = too_slow(self.read_timeout_s, num_read)
                await refused.response(scope["path"])(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunks.append(message.get("body", b""))
            num_read += len(chunks[-1])
            if num_read > self.max_bytes:
                await too_large(self.max_bytes).response(scope["path"])(scope, receive, send)
                return
            more = message.get("more_body", False)
        body: Message | None = {"type": "http.request", "more_body": False}
        body["body"] = b"".join(chunks)
        del chunks

        async def receive_read() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, receive_read, send)
