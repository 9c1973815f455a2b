"""Server-sent events in OpenAI's streaming format.

    data: {first chunk}          chat: delta {"role": "assistant", "content": ""}
    data: {chunk}                one per engine event that released text (or logprobs)
    data: {last chunk}           empty delta, finish_reason set
    data: {usage chunk}          only with stream_options.include_usage: choices [], usage
                                 (then every chunk before it has "usage": null)
    data: [DONE]

The first engine event is awaited before the response starts, so a request that fails at once
(expert workers unavailable, ...) gets its HTTP status; a failure later is sent as
`data: {"error": {...}}` (the openai client raises it) and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from gpu_service.api.generation import Generation, finish_error, unless_disconnected
from gpu_service.engine.request import TokenEvent

DONE = "data: [DONE]\n\n"


class ChunkWriter(Protocol):
    """Turns engine events into one API's chunks (chat or completions)."""

    def head(self) -> list[dict]: ...

    def event(self, event: TokenEvent) -> dict | None: ...

    def finish(self, reason: str) -> dict: ...

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict: ...


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_response(
    request: Request, generation: Generation, writer: ChunkWriter, include_usage: bool
) -> StreamingResponse:
    try:
        first = await unless_disconnected(request, generation.next_event())
    except BaseException:
        generation.close()
        raise
    error = finish_error(first)
    if error is not None:
        raise error
    return StreamingResponse(
        _chunks(generation, first, writer, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _chunks(
    generation: Generation, event: TokenEvent, writer: ChunkWriter, include_usage: bool
) -> AsyncIterator[str]:
    # NOTE: the finally runs when the client disconnects too (Starlette cancels this generator):
    # that is what aborts the request in the engine.
    num_tokens = 0

    def emit(chunk: dict) -> str:
        if include_usage:  # as OpenAI does: every chunk but the last has "usage": null
            chunk.setdefault("usage", None)
        return sse(chunk)

    try:
        for chunk in writer.head():
            yield emit(chunk)
        while True:
            error = finish_error(event)
            if error is not None:
                yield sse(error.body())
                yield DONE
                return
            num_tokens += len(event.tokens)
            chunk = writer.event(event)
            if chunk is not None:
                yield emit(chunk)
            if event.finish_reason is not None:
                yield emit(writer.finish(event.finish_reason.value))
                break
            event = await generation.next_event()
        if include_usage:
            yield sse(writer.usage(generation.num_prompt_tokens, num_tokens))
        yield DONE
    finally:
        generation.close()
