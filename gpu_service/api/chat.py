"""POST /v1/chat/completions: messages (and tools) through the checkpoint's chat template; the
output read back as reasoning, content and tool calls (chat_output.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.chat_output import Delta, GrammarSpec, OutputReader, plan_output
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.generation import collect_all, unless_disconnected
from gpu_service.api.logprobs import chat_logprobs
from gpu_service.api.parsing import check_request, choice_params, parse_body, sampling_params
from gpu_service.api.reasoning import prompt_opens_thinking
from gpu_service.api.schemas import ChatCompletionRequest
from gpu_service.api.streaming import stream_response
from gpu_service.api.tokenizer import TokenizerError
from gpu_service.engine.grammar import Grammar, GrammarError
from gpu_service.engine.request import TokenEvent

# NOTE: what apply_chat_template itself takes; chat_template_kwargs cannot set these.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
     "continue_final_message", "return_dict", "chat_template", "tokenizer_kwargs"}
)  # fmt: skip


async def create_chat_completion(request: Request, ctx: ApiContext) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    check_request(ctx, body)
    check_messages(body)
    prompt_ids, prompt_text = await render(ctx, body)
    prompt_opened = prompt_opens_thinking(prompt_text)
    plan = plan_output(ctx, body, prompt_opened)
    grammar = await compile_grammar(ctx, plan.grammar) if plan.grammar is not None else None
    want_logprobs = body.logprobs
    params = sampling_params(
        body,
        ctx.max_tokens_for(prompt_ids, body.max_new_tokens),
        want_logprobs,
        body.top_logprobs or 0,
        grammar=grammar,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    per_choice = choice_params(params, body.n)
    generations = await ctx.choices(request, body, prompt_ids, per_choice, request_id,
                                    prompt_param="messages")  # fmt: skip
    writers = [
        ChatChunks(ctx, request_id, want_logprobs, OutputReader(plan, prompt_opened), index=i)
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
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": writers[0].created,
            "model": ctx.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(o.tokens) for o in outs)),
        }
    )


def check_messages(body: ChatCompletionRequest) -> None:
    for i, m in enumerate(body.messages):
        if m.role == "function":
            raise invalid(
                "role 'function' is deprecated and not supported: use role 'tool'",
                param=f"messages.{i}.role",
            )
        if m.tool_calls and m.role != "assistant":
            raise invalid("only assistant messages have tool_calls", param=f"messages.{i}")
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid(
                    "a tool message needs tool_call_id (the id of the call it answers)",
                    param=f"messages.{i}.tool_call_id",
                )
        elif m.tool_call_id is not None:
            raise invalid("only tool messages have tool_call_id", param=f"messages.{i}")


async def render(ctx: ApiContext, body: ChatCompletionRequest) -> tuple[list[int], str]:
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs cannot set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        return await ctx.render_chat(
            lambda as_text: [m.to_template(as_text) for m in body.messages], tools, kwargs
        )
    except (TokenizerError, ValueError) as exc:
        raise invalid(str(exc), param="messages") from exc


async def compile_grammar(ctx: ApiContext, spec: GrammarSpec) -> Grammar:
    """Compiled in a worker thread: a large schema takes a while, and the engine never waits."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, ctx.grammars.compile_lark, spec.lark)
    except GrammarError as exc:
        raise invalid(
            f"cannot constrain the output to this {spec.param}: {exc}", param=spec.param
        ) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return chunk
