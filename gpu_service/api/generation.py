"""The engine seen from the event loop.

The engine calls back on its own thread; each request gets an asyncio.Queue that those callbacks
fill through loop.call_soon_threadsafe. A request whose consumer goes away (client disconnect,
cancelled handler) is aborted in the engine, which frees its slot and KV blocks. `end(error)`
finishes one from the event loop (its deadline passed, the server shuts down): its consumer reads
the events already queued, then an end carrying the error, as if the engine had sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from gpu_service.api.errors import ApiError, from_engine
from gpu_service.engine import Engine, EngineError, SampledToken, SamplingParams
from gpu_service.engine.errors import DeadlineExceeded
from gpu_service.engine.request import FinishReason, TokenEvent

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class Generation:
    """One engine request: iterate its events; `close()` aborts it unless it finished. A request
    the engine refuses raises its ApiError here (prompt_param: the body's field of the prompt).
    timeout_s: seconds from now after which it ends with DeadlineExceeded (None: never)."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prompt_param: str,
        timeout_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.finished = False
        self._ended = False
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._deadline: asyncio.TimerHandle | None = None
        self.started = asyncio.Event()  # set by its first event (the prompt is in the KV cache)
        loop = asyncio.get_running_loop()

        def put(event: TokenEvent) -> None:
            self._queue.put_nowait(event)
            self.started.set()

        def on_event(event: TokenEvent) -> None:  # engine thread
            # NOTE: RuntimeError: the event loop is closed; nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(put, event)

        try:
            engine.add_request(prompt_ids, params, on_event, request_id)
        except EngineError as exc:
            raise from_engine(exc, prompt_param) from exc
        if timeout_s is not None:
            expired = DeadlineExceeded(
                f"the request did not finish within its timeout of {timeout_s:g} s"
            )
            self._deadline = loop.call_later(timeout_s, self.end, expired)

    async def next_event(self) -> TokenEvent:
        event = await self._queue.get()
        if event.finish_reason is not None:
            self.finished = True
        return event

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            yield await self.next_event()

    def end(self, error: EngineError) -> None:
        """Finish it now (event loop only): aborted in the engine; its consumer reads what was
        queued, then an end with FinishReason.ERROR carrying `error`."""
        if self.finished or self._ended:
            return
        self._ended = True
        self.engine.abort(self.request_id)
        end = TokenEvent(self.request_id, (), finish_reason=FinishReason.ERROR, error=error,
                         num_prompt_tokens=self.num_prompt_tokens)  # fmt: skip
        self._queue.put_nowait(end)
        self.started.set()

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if not self.finished:
            self.finished = True
            if not self._ended:
                self.engine.abort(self.request_id)


def finish_error(event: TokenEvent) -> ApiError | None:
    """The HTTP error of a request that ended with ERROR or ABORT (None for stop and length)."""
    return from_engine(event.error) if event.error is not None else None


@dataclass
class Outcome:
    """Everything a non-streamed request produced."""

    text: str = ""
    tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str = "stop"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache


async def collect(generation: Generation) -> Outcome:
    out = Outcome(num_prompt_tokens=generation.num_prompt_tokens)
    try:
        async for event in generation:
            out.text += event.text
            out.tokens.extend(event.tokens)
            out.num_cached_tokens = event.num_cached_tokens
            if event.finish_reason is not None:
                error = finish_error(event)
                if error is not None:
                    raise error
                out.finish_reason = event.finish_reason.value
    finally:
        generation.close()
    return out


async def collect_all(generations: Sequence[Generation]) -> list[Outcome]:
    """Every choice's Outcome; if one fails, the others are closed and its error raised."""
    tasks = [asyncio.ensure_future(collect(g)) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (which aborts its generation) if the client disconnects first.
    Call only once the body has been read: then `receive` answers only with the disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # the client left: whatever it ended with goes nowhere
        raise ClientGone()
    return task.result()
