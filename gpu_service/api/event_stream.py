"""Typed server-sent events (`event: TYPE` then `data: {...}`), as the Responses and the
Messages APIs stream, from one generation through an EventBuilder; and the same builder drained
for a whole answer, so both ways end in the same object.

As streaming.py's streams: the first engine event is awaited before the response starts (a
request that fails at once gets its HTTP status); a failure later is the builder's failed()
events, and the stream ends. No [DONE]: the last event says the answer is complete.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from gpu_service.api.access import report_usage
from gpu_service.api.errors import ApiError
from gpu_service.api.generation import Generation, finish_error, unless_disconnected
from gpu_service.api.streaming import first_events, sse_response
from gpu_service.engine.request import TokenEvent


class EventBuilder(Protocol):
    """One API's events of one answer; each event a dict with its "type"."""

    num_prompt: int
    num_output: int

    def head(self, first: TokenEvent) -> list[dict]: ...

    def event(self, event: TokenEvent) -> list[dict]: ...

    def finish(self, event: TokenEvent) -> list[dict]: ...

    def failed(self, error: ApiError) -> list[dict]: ...


def typed_sse(payload: dict) -> str:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


async def stream_events(request: Request, generation: Generation,
                        builder: EventBuilder) -> StreamingResponse:  # fmt: skip
    (first,) = await first_events(request, [generation])
    return sse_response(_events(request.scope, generation, first, builder))


async def drain(request: Request, generation: Generation, builder: EventBuilder) -> None:
    """Feed the builder the whole answer (its events go nowhere); raises the ApiError of a
    request that failed."""

    async def run() -> None:
        try:
            async for event in generation:
                error = finish_error(event)
                if error is not None:
                    raise error
                if event.finish_reason is not None:
                    builder.finish(event)
                else:
                    builder.event(event)
        finally:
            generation.close()

    await unless_disconnected(request, run())
    report_usage(request.scope, builder.num_prompt, builder.num_output)


async def _events(scope: dict, generation: Generation, first: TokenEvent,
                  builder: EventBuilder) -> AsyncIterator[str]:  # fmt: skip
    # NOTE: the finally runs when the client disconnects too (Starlette cancels this generator):
    # that is what aborts the request in the engine.
    try:
        for payload in builder.head(first):
            yield typed_sse(payload)
        event = first
        while True:
            error = finish_error(event)
            if error is not None:
                payloads, done = builder.failed(error), True
            elif event.finish_reason is not None:
                payloads, done = builder.finish(event), True
            else:
                payloads, done = builder.event(event), False
            for payload in payloads:
                yield typed_sse(payload)
            if done:
                return
            event = await generation.next_event()
    finally:
        report_usage(scope, builder.num_prompt, builder.num_output)
        generation.close()
