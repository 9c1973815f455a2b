"""Server-sent events in OpenAI's streaming format.

    data: {first chunk}          chat: delta {"role": "assistant", "content": ""}, per choice
    data: {chunk}                one per engine event that released text (or logprobs)
    data: {last chunk}           a choice's empty delta, finish_reason set
    data: {usage chunk}          only with stream_options.include_usage: choices [], usage
                                 (then every chunk before it has "usage": null)
    data: [DONE]

With n > 1 each choice's chunks carry its index; the choices' chunks interleave as their tokens
come, each choice's in order; usage sums the choices' tokens (the prompt counted once).

The first engine event is awaited before the response starts, so a request that fails at once
(expert workers unavailable, ...) gets its HTTP status; a failure later is sent as
`data: {"error": {...}}` (the openai client raises it) and the stream ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from gpu_service.api.access import report_usage
from gpu_service.api.generation import Generation, finish_error, unless_disconnected
from gpu_service.engine.request import TokenEvent

DONE = "data: [DONE]\n\n"


class ChunkWriter(Protocol):
    """Turns engine events into one API's chunks (chat or completions)."""

    def head(self) -> list[dict]: ...

    def event(self, event: TokenEvent) -> dict | None: ...

    def finish(self, reason: str) -> dict: ...

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict: ...


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def first_events(request: Request, generations: Sequence[Generation]) -> list[TokenEvent]:
    """Each generation's first event, awaited before a response starts: a request that failed
    at once raises its ApiError (the response's status), and every generation is closed."""
    try:
        firsts = await unless_disconnected(
            request, asyncio.gather(*(g.next_event() for g in generations))
        )
    except BaseException:
        for generation in generations:
            generation.close()
        raise
    for first in firsts:
        error = finish_error(first)
        if error is not None:
            for generation in generations:
                generation.close()
            raise error
    return firsts


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def stream_response(
    request: Request,
    generations: Sequence[Generation],
    writers: Sequence[ChunkWriter],
    include_usage: bool,
) -> StreamingResponse:
    """One stream of n choices: generations[i]'s events become writers[i]'s chunks (choice i)."""
    firsts = await first_events(request, generations)
    return sse_response(_chunks(request.scope, generations, firsts, writers, include_usage))


async def merged(
    generations: Sequence[Generation], firsts: Sequence[TokenEvent]
) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) as each generation's events come (in order within a choice),
    starting with the first events already read."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, event in enumerate(firsts):
            yield i, event
            if event.finish_reason is None:
                pending[asyncio.ensure_future(generations[i].next_event())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                event = task.result()
                yield i, event
                if event.finish_reason is None:
                    pending[asyncio.ensure_future(generations[i].next_event())] = i
    finally:
        for task in pending:
            task.cancel()


async def _chunks(
    scope: dict,
    generations: Sequence[Generation],
    firsts: Sequence[TokenEvent],
    writers: Sequence[ChunkWriter],
    include_usage: bool,
) -> AsyncIterator[str]:
    # NOTE: the finally runs when the client disconnects too (Starlette cancels this generator):
    # that is what aborts the requests in the engine.
    num_tokens = 0
    num_prompt, num_cached = generations[0].num_prompt_tokens, firsts[0].num_cached_tokens

    def emit(chunk: dict) -> str:
        if include_usage:  # as OpenAI does: every chunk but the last has "usage": null
            chunk.setdefault("usage", None)
        return sse(chunk)

    events = merged(generations, firsts)
    try:
        for writer in writers:
            for chunk in writer.head():
                yield emit(chunk)
        async for i, event in events:
            error = finish_error(event)
            if error is not None:
                yield sse(error.body())
                yield DONE
                return
            num_tokens += len(event.tokens)
            chunk = writers[i].event(event)
            if chunk is not None:
                yield emit(chunk)
            if event.finish_reason is not None:
                yield emit(writers[i].finish(event.finish_reason.value))
        if include_usage:
            yield sse(writers[0].usage(num_prompt, num_tokens, num_cached))
        yield DONE
    finally:
        report_usage(scope, num_prompt, num_tokens)
        await events.aclose()
        for generation in generations:
            generation.close()
