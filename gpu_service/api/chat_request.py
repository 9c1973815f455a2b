"""The one internal request under every chat-shaped API. Chat completions, responses and
messages each translate their body into a ChatRequest (messages as chat templates take them,
function tools, a tool choice, an output format, sampling); from there the path is one:

    prepare_chat(ctx, req)     the prompt through the chat template (tools, the thinking switch),
                               the output planned (chat_output.plan_output: tool parser,
                               reasoning split, grammar), the grammar compiled, SamplingParams
    start_chat(...)            one Generation per choice (ctx.choices)
    OutputReader(plan)         the text read back as reasoning, content and tool calls

so a feature (tools, grammars, reasoning, logprobs, the prefix cache's usage) is written once
and each API only translates its shapes to and from these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.requests import Request

from gpu_service.api.chat_output import GrammarSpec, OutputPlan, OutputReader, plan_output
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.generation import Generation
from gpu_service.api.parsing import SamplingFields, choice_params, sampling_params
from gpu_service.api.reasoning import prompt_opens_thinking
from gpu_service.api.schemas import ChatMessage
from gpu_service.api.tokenizer import TokenizerError
from gpu_service.api.tool_schemas import NamedToolChoice, ResponseFormat, Tool
from gpu_service.engine import SamplingParams
from gpu_service.engine.grammar import Grammar, GrammarError

# NOTE: what apply_chat_template itself takes; chat_template_kwargs cannot set these.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
     "continue_final_message", "return_dict", "chat_template", "tokenizer_kwargs"}
)  # fmt: skip

ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


@dataclass
class ChatRequest:
    """What a chat-shaped request asks. *_param: the body's field an error about that part
    names (the APIs call them differently: messages / input, response_format / text.format)."""

    messages: list[ChatMessage]
    sampling: SamplingFields = field(default_factory=SamplingFields)
    max_tokens: int | None = None
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking: bool | None = None  # the template's thinking switch, where it has one
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    timeout: float | None = None  # seconds (ctx.generation reads it)
    messages_param: str = "messages"
    format_param: str = "response_format"


@dataclass
class PreparedChat:
    request: ChatRequest
    prompt_ids: list[int]
    prompt_opened: bool  # the prompt ends inside an open <think>
    plan: OutputPlan
    params: SamplingParams

    def reader(self) -> OutputReader:
        return OutputReader(self.plan, self.prompt_opened)


def check_messages(messages: list[ChatMessage], param: str = "messages") -> None:
    for i, m in enumerate(messages):
        if m.role == "function":
            raise invalid(
                "role 'function' is deprecated and not supported: use role 'tool'",
                param=f"{param}.{i}.role",
            )
        if m.tool_calls and m.role != "assistant":
            raise invalid("only assistant messages have tool_calls", param=f"{param}.{i}")
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid(
                    "a tool message needs tool_call_id (the id of the call it answers)",
                    param=f"{param}.{i}.tool_call_id",
                )
        elif m.tool_call_id is not None:
            raise invalid("only tool messages have tool_call_id", param=f"{param}.{i}")


async def render(ctx: ApiContext, messages: list[ChatMessage], tools: list[Tool] | None,
                 template_kwargs: dict[str, Any] | None, thinking: bool | None = None,
                 param: str = "messages") -> tuple[list[int], str]:  # fmt: skip
    """Prompt ids and text of the conversation through the checkpoint's template."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid(
            f"chat_template_kwargs cannot set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    switch = ctx.tokenizer.thinking_switch
    if thinking is not None and switch is not None:
        kwargs.setdefault(switch, thinking)
    dumped = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        return await ctx.render_chat(
            lambda as_text: [m.to_template(as_text) for m in messages], dumped, kwargs,
            param=param,
        )  # fmt: skip
    except (TokenizerError, ValueError) as exc:
        raise invalid(str(exc), param=param) from exc


async def compile_grammar(ctx: ApiContext, spec: GrammarSpec) -> Grammar:
    """Compiled in a worker thread: a large schema takes a while, and the engine never waits."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, ctx.grammars.compile_lark, spec.lark)
    except GrammarError as exc:
        raise invalid(
            f"cannot constrain the output to this {spec.param}: {exc}", param=spec.param
        ) from None


async def prepare_chat(ctx: ApiContext, req: ChatRequest) -> PreparedChat:
    check_messages(req.messages, req.messages_param)
    prompt_ids, prompt_text = await render(ctx, req.messages, req.tools, req.template_kwargs,
                                           req.thinking, req.messages_param)  # fmt: skip
    prompt_opened = prompt_opens_thinking(prompt_text)
    plan = plan_output(ctx, req, prompt_opened)
    grammar = await compile_grammar(ctx, plan.grammar) if plan.grammar is not None else None
    params = sampling_params(req.sampling, ctx.max_tokens_for(prompt_ids, req.max_tokens),
                             req.logprobs, req.top_logprobs, grammar=grammar)  # fmt: skip
    return PreparedChat(req, prompt_ids, prompt_opened, plan, params)


async def start_chat(request: Request, ctx: ApiContext, prepared: PreparedChat,
                     request_id: str) -> list[Generation]:  # fmt: skip
    """One generation per choice of the prepared request."""
    req = prepared.request
    per_choice = choice_params(prepared.params, req.n)
    return await ctx.choices(request, req, prepared.prompt_ids, per_choice, request_id,
                             prompt_param=req.messages_param)  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Chat completions' usage (the prompt's tokens found in the prefix cache in its details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
