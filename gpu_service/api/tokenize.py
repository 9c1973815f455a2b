"""POST /tokenize and POST /detokenize in vLLM's shapes.

    /tokenize    {"prompt": text, "add_special_tokens": true}
                 or {"messages": [...], "tools", "chat_template_kwargs"} (the chat template's
                 prompt, as /v1/chat/completions renders it)
                 -> {"count", "max_model_len", "tokens", "token_strs"}  (strs with
                 return_token_strs)
    /detokenize  {"tokens": [ids]} -> {"prompt": text}  (special tokens included)

`model` is optional; when sent it must be the served name.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.requests import Request

from gpu_service.api.chat_request import check_messages, render
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.parsing import parse_body
from gpu_service.api.schemas import ChatMessage, _Body
from gpu_service.api.tool_schemas import Tool


class _TokenizerBody(_Body):
    model: str | None = None

    def check(self, ctx: ApiContext) -> None:
        if self.model is not None:
            ctx.check_model(self.model)
        unknown = self.unknown_fields()
        if unknown:
            raise invalid(f"{unknown[0]} is not supported by this server", param=unknown[0])


class TokenizeRequest(_TokenizerBody):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(_TokenizerBody):
    tokens: list[int]


async def tokenize(request: Request, ctx: ApiContext) -> JSONResponse:
    body = await parse_body(request, TokenizeRequest)
    body.check(ctx)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("send either prompt or messages", param="prompt")
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise invalid(
                "add_generation_prompt false is not supported: the prompt ends with the "
                "assistant's turn opened, as chat completions render it",
                param="add_generation_prompt",
            )
        if body.add_special_tokens:
            raise invalid(
                "add_special_tokens is not supported with messages (the template writes them)",
                param="add_special_tokens",
            )
        check_messages(body.messages)
        ids, _ = await render(ctx, body.messages, body.tools, body.chat_template_kwargs)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await ctx.encode_prompt(body.prompt, add_special_tokens=add_special)
    strs = ctx.tokenizer.token_texts(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                         "token_strs": strs})  # fmt: skip


async def detokenize(request: Request, ctx: ApiContext) -> JSONResponse:
    body = await parse_body(request, DetokenizeRequest)
    body.check(ctx)
    vocab = ctx.engine.limits.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise invalid(f"token ids must be in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode_all(body.tokens)})
