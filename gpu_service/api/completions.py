"""POST /v1/completions: a prompt as text or as token ids."""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.access import report_usage
from gpu_service.api.chat_request import usage
from gpu_service.api.context import ApiContext
from gpu_service.api.generation import collect_all, unless_disconnected
from gpu_service.api.logprobs import CompletionLogprobs
from gpu_service.api.parsing import (
    check_request,
    choice_params,
    parse_body,
    sampling_fields,
    sampling_params,
)
from gpu_service.api.schemas import CompletionRequest
from gpu_service.api.streaming import stream_response
from gpu_service.engine.request import TokenEvent


async def create_completion(request: Request, ctx: ApiContext) -> Response:
    body = await parse_body(request, CompletionRequest)
    check_request(ctx, body)
    prompt = body.single_prompt()
    prompt_ids = await ctx.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    want_logprobs = body.logprobs is not None
    params = sampling_params(
        sampling_fields(body),
        ctx.max_tokens_for(prompt_ids, body.max_tokens),
        want_logprobs,
        body.logprobs or 0,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    per_choice = choice_params(params, body.n)
    generations = await ctx.choices(request, body, prompt_ids, per_choice, request_id,
                                    prompt_param="prompt")  # fmt: skip
    writers = [CompletionChunks(ctx, request_id, want_logprobs, index=i) for i in range(body.n)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(request, generations, writers, include_usage)
    outs = await unless_disconnected(request, collect_all(generations))
    choices = [
        writer.choice(out.text, writer.logprobs(out.tokens) if writer.logprobs else None,
                      out.finish_reason)
        for writer, out in zip(writers, outs)
    ]  # fmt: skip
    num_completion = sum(len(o.tokens) for o in outs)
    report_usage(request.scope, len(prompt_ids), num_completion)
    response = writers[0].chunk("", None, None) | {
        "usage": usage(len(prompt_ids), num_completion, outs[0].num_cached_tokens)
    }
    response["choices"] = choices
    return JSONResponse(response)


class CompletionChunks:
    """text_completion objects; the stream's chunks have the same shape as the whole answer."""

    def __init__(self, ctx: ApiContext, request_id: str, logprobs: bool, index: int = 0) -> None:
        """index: the choice's."""
        self.ctx = ctx
        self.index = index
        self.request_id = request_id
        self.logprobs = CompletionLogprobs(ctx.tokenizer) if logprobs else None
        self.created = int(time.time())

    def chunk(self, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "system_fingerprint": None,
            "choices": [self.choice(text, logprobs, finish_reason)],
        }

    def choice(self, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}  # fmt: skip

    def head(self) -> list[dict]:
        return []

    def event(self, event: TokenEvent) -> dict | None:
        logprobs = self.logprobs(event.tokens) if self.logprobs and event.tokens else None
        if not event.text and logprobs is None:
            return None
        return self.chunk(event.text, logprobs, None)

    def finish(self, reason: str) -> dict:
        return self.chunk("", None, reason)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        chunk = self.chunk("", None, None)
        chunk["choices"] = []
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk
