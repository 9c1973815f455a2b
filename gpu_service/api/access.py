"""Every request counted and logged, as a plain ASGI middleware (streams pass untouched).

    ktserve_http_requests{method, route, status}
        route: the route's template (/v1/models/{model}); a path no route answers gets a bounded
        label: its first two segments, each cut to 32 characters of [A-Za-z0-9_.-], at most
        MAX_OTHER_LABELS distinct ones, then "other" (a scan of random paths adds one series)
    ktserve.access log, one line a request (unless --no-access-log):
        METHOD PATH STATUS SECONDS prompt_tokens=N completion_tokens=N

Handlers say what a request cost with report_usage(scope, ...); a stream reports it when it
ends, which is before this middleware's call returns.
"""

from __future__ import annotations

import logging
import re
import time

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ktserve.access")

USAGE_KEY = "ktserve.usage"
MAX_OTHER_LABELS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def report_usage(scope: Scope, prompt_tokens: int, completion_tokens: int) -> None:
    """The token counts of the request this scope is, for its access log line."""
    scope[USAGE_KEY] = (prompt_tokens, completion_tokens)


class RouteLabels:
    """The route label of a path: a known route's template, else a bounded label."""

    def __init__(self, routes: tuple[str, ...]) -> None:
        self.exact = {r for r in routes if "{" not in r}
        self.prefixes = {r.split("{", 1)[0]: r for r in routes if "{" in r}
        self.others: set[str] = set()

    def __call__(self, path: str) -> str:
        if path in self.exact:
            return path
        for prefix, route in self.prefixes.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                return route
        segments = [_UNSAFE.sub("_", s)[:32] for s in path.split("/") if s][:2]
        label = "/" + "/".join(segments)
        if label in self.others:
            return label
        if len(self.others) < MAX_OTHER_LABELS:
            self.others.add(label)
            return label
        return "other"


class AccessMiddleware:
    def __init__(self, app: ASGIApp, counter: Counter, labels: RouteLabels,
                 access_log: bool) -> None:  # fmt: skip
        self.app = app
        self.counter = counter
        self.labels = labels
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = {"code": 500}

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            method, path = scope["method"], scope["path"]
            route = self.labels(path)
            self.counter.labels(method=method, route=route, status=str(status["code"])).inc()
            if self.access_log:
                prompt, completion = scope.get(USAGE_KEY, ("-", "-"))
                log.info("%s %s %d %.3fs prompt_tokens=%s completion_tokens=%s", method,
                         ascii(path)[1:-1], status["code"], time.monotonic() - start, prompt,
                         completion)  # fmt: skip
