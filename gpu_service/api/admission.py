"""Which requests the server takes on, as a plain ASGI middleware (streams pass untouched).

    accepting ──SIGTERM──▶ draining: new requests get 503 (shutting_down), running ones go on
                           (api/shutdown.py waits for `idle`, then ends the rest)

While accepting, at most `max_in_flight` requests are served at once (the engine's max_num_seqs
plus --max-waiting-requests that wait: being read, tokenized or queued); one more gets 429
(too_many_requests) with Retry-After, before a byte of its body is read. /health and /metrics are
never refused here.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from gpu_service.api.errors import ApiError

RETRY_AFTER_S = 1
UNGATED = ("/health", "/metrics")


class Admission:
    """In-flight requests against their bound (None: unbounded), and the draining flag."""

    def __init__(self, max_in_flight: int | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.draining = False
        self.num_refused = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> None:
        """Count one more request in, or raise its 503 (draining) or 429 (full) ApiError."""
        if self.draining:
            raise ApiError(
                503, "the server is shutting down; send the request to another one",
                code="shutting_down",
            )  # fmt: skip
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            self.num_refused += 1
            raise ApiError(
                429,
                f"the server is overloaded: {self.in_flight} requests are running or waiting, "
                f"its bound (--max-num-seqs + --max-waiting-requests); retry after "
                f"{RETRY_AFTER_S} s",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every admitted request finished within timeout seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGATED:
            await self.app(scope, receive, send)
            return
        try:
            self.admission.admit()
        except ApiError as exc:
            await exc.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release()
