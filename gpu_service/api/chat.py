"""POST /v1/chat/completions: messages through the checkpoint's chat template."""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.generation import collect, unless_disconnected
from gpu_service.api.logprobs import chat_logprobs
from gpu_service.api.parsing import check_request, parse_body, sampling_params
from gpu_service.api.schemas import ChatCompletionRequest
from gpu_service.api.streaming import stream_response
from gpu_service.api.tokenizer import TokenizerError
from gpu_service.engine.request import TokenEvent


async def create_chat_completion(request: Request, ctx: ApiContext) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    check_request(ctx, body)
    try:
        messages = [m.to_template() for m in body.messages]
        prompt_ids = await ctx.render_chat(messages)
    except (TokenizerError, ValueError) as exc:
        raise invalid(str(exc), param="messages") from exc
    want_logprobs = body.logprobs
    params = sampling_params(
        body,
        ctx.max_tokens_for(prompt_ids, body.max_new_tokens),
        want_logprobs,
        body.top_logprobs or 0,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = ctx.generation(body, prompt_ids, params, request_id, prompt_param="messages")
    writer = ChatChunks(ctx, request_id, want_logprobs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(request, generation, writer, include_usage)
    out = await unless_disconnected(request, collect(generation))
    logprobs = chat_logprobs(ctx.tokenizer, out.tokens) if want_logprobs else None
    num_tokens = len(out.tokens)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": writer.created,
            "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            ],
            "usage": usage(out.num_prompt_tokens, num_tokens),
        }
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChatChunks:
    """chat.completion.chunk objects (see streaming.py for their order)."""

    def __init__(self, ctx: ApiContext, request_id: str, logprobs: bool) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.logprobs = logprobs
        self.created = int(time.time())

    def _chunk(self, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }

    def head(self) -> list[dict]:
        delta = {"role": "assistant", "content": ""}
        return [
            self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        ]

    def event(self, event: TokenEvent) -> dict | None:
        logprobs = None
        if self.logprobs and event.tokens:
            logprobs = chat_logprobs(self.ctx.tokenizer, event.tokens)
        if not event.text and logprobs is None:
            return None
        delta = {"content": event.text} if event.text else {}
        return self._chunk(
            [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        )

    def finish(self, reason: str) -> dict:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return chunk
