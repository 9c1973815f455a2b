"""POST /v1/chat/completions: the body as the internal ChatRequest (chat_request.py), its
output read back as reasoning, content and tool calls (chat_output.py) into OpenAI's shapes."""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.access import report_usage
from gpu_service.api.chat_output import Delta, OutputReader
from gpu_service.api.chat_request import ChatRequest, prepare_chat, start_chat, usage
from gpu_service.api.context import ApiContext
from gpu_service.api.generation import collect_all, unless_disconnected
from gpu_service.api.logprobs import chat_logprobs
from gpu_service.api.parsing import check_request, parse_body, sampling_fields
from gpu_service.api.schemas import ChatCompletionRequest
from gpu_service.api.streaming import stream_response
from gpu_service.engine.request import TokenEvent


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """Chat completions' body as the internal request."""
    return ChatRequest(
        messages=body.messages,
        sampling=sampling_fields(body),
        max_tokens=body.max_new_tokens,
        tools=body.tools or [],
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format,
        template_kwargs=body.chat_template_kwargs or {},
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        n=body.n,
        timeout=body.timeout,
    )


async def create_chat_completion(request: Request, ctx: ApiContext) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    check_request(ctx, body)
    prepared = await prepare_chat(ctx, chat_request(body))
    want_logprobs = body.logprobs
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generations = await start_chat(request, ctx, prepared, request_id)
    writers = [
        ChatChunks(ctx, request_id, want_logprobs, prepared.reader(), index=i)
        for i in range(body.n)
    ]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(request, generations, writers, include_usage)
    outs = await unless_disconnected(request, collect_all(generations))
    choices = []
    for writer, out in zip(writers, outs):
        reader = writer.reader
        logprobs = chat_logprobs(ctx.tokenizer, out.tokens) if want_logprobs else None
        parts, rest = reader.feed(out.text), reader.finish()
        message = writer.message(parts.reasoning + rest.reasoning, parts.content + rest.content)
        choices.append(
            {
                "index": writer.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reader.finish_reason(out.finish_reason),
            }
        )
    num_prompt, num_completion = len(prepared.prompt_ids), sum(len(o.tokens) for o in outs)
    report_usage(request.scope, num_prompt, num_completion)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": writers[0].created,
            "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(num_prompt, num_completion, outs[0].num_cached_tokens),
        }
    )


class ChatChunks:
    """chat.completion.chunk objects (see streaming.py for their order)."""

    def __init__(self, ctx: ApiContext, request_id: str, logprobs: bool,
                 reader: OutputReader, index: int = 0) -> None:  # fmt: skip
        """index: the choice's."""
        self.ctx = ctx
        self.index = index
        self.request_id = request_id
        self.logprobs = logprobs
        self.reader = reader
        self.created = int(time.time())

    def message(self, reasoning: str, content: str) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if self.reader.splitter is not None:
            message["reasoning_content"] = reasoning.rstrip() or None
        calls = self.reader.calls
        if calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message

    def _delta(self, parts: Delta) -> dict:
        delta: dict = {}
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts.content:
            delta["content"] = parts.content
        if parts.calls:
            delta["tool_calls"] = [c.to_openai() for c in parts.calls]
        return delta

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
            self._chunk(
                [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}]
            )
        ]

    def event(self, event: TokenEvent) -> dict | None:
        logprobs = None
        if self.logprobs and event.tokens:
            logprobs = chat_logprobs(self.ctx.tokenizer, event.tokens)
        parts = self.reader.feed(event.text) if event.text else Delta()
        if not parts and logprobs is None:
            return None
        return self._chunk(
            [{"index": self.index, "delta": self._delta(parts), "logprobs": logprobs,
              "finish_reason": None}]
        )  # fmt: skip

    def finish(self, reason: str) -> dict:
        delta = self._delta(self.reader.finish())
        reason = self.reader.finish_reason(reason)
        return self._chunk(
            [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": reason}]
        )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return chunk
