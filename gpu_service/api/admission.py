"""Which requests the server takes on, as plain ASGI middlewares (streams pass untouched).

    accepting ──SIGTERM──▶ draining: new requests get 503 (shutting_down), running ones go on
                           (api/shutdown.py waits for `idle`, then ends the rest)

While accepting, at most `max_in_flight` requests are served at once (the engine's max_num_seqs
plus --max-waiting-requests that wait: tokenized or queued); one more gets 429
(too_many_requests) with Retry-After. A request counts only once its body is read whole
(limits.py reads it, within --request-read-timeout), so a client that uploads slowly holds no slot;
one that would be refused already as it arrives is refused before a byte of its body is read
(RefuseEarly). /health, /metrics and / are never refused here.

Retry-After estimates when the queue ahead of a refused request will have drained: the waiting
requests times the mean time a recent request held a running slot (the engine's mean_run_s),
over the running slots, in whole seconds within [1, 60].
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gpu_service.api.errors import ApiError

MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S = 1, 60
UNGATED = ("/health", "/metrics", "/")


class Admission:
    """In-flight requests against their bound (None: unbounded), and the draining flag.
    num_slots: requests the engine runs at once; mean_run_s: seconds a recent request ran
    (None: none finished yet), both for Retry-After."""

    def __init__(self, max_in_flight: int | None = None, num_slots: int = 1,
                 mean_run_s: Callable[[], float | None] = lambda: None) -> None:  # fmt: skip
        self.max_in_flight = max_in_flight
        self.num_slots = num_slots
        self.mean_run_s = mean_run_s
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def retry_after_s(self) -> int:
        """Seconds until the requests waiting now will have started, by recent run times."""
        mean = self.mean_run_s()
        waiting = max(self.in_flight - self.num_slots, 0)
        running = max(min(self.in_flight, self.num_slots), 1)
        estimate = math.ceil(waiting * mean / running) if mean else MIN_RETRY_AFTER_S
        return min(max(estimate, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)

    def refusal(self) -> ApiError | None:
        """The 503 (draining) or 429 (full) a request arriving now gets; None: it may come in."""
        if self.draining:
            return ApiError(
                503, "the server is shutting down; send the request to another one",
                code="shutting_down",
            )  # fmt: skip
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            retry_after = self.retry_after_s()
            return ApiError(
                429,
                f"the server is overloaded: {self.in_flight} requests are running or waiting, "
                f"its bound (--max-num-seqs + --max-waiting-requests); retry after "
                f"{retry_after} s",
                code="too_many_requests",
                headers={"Retry-After": str(retry_after)},
            )
        return None

    def admit(self) -> None:
        """Count one more request in, or raise its 503 (draining) or 429 (full) ApiError."""
        refused = self.refusal()
        if refused is not None:
            raise refused
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


class RefuseEarly:
    """Outside the body's reading: a request that would be refused now is, unread and uncounted."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNGATED:
            refused = self.admission.refusal()
            if refused is not None:
                await refused.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AdmissionMiddleware:
    """Inside the body's reading: counts the request in (or refuses it) until its response ends."""

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
            await exc.response(scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release()
