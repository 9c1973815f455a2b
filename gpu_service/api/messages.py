"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens: the body as
the internal ChatRequest (messages_input.py), its output as content blocks and Anthropic's
events (messages_output.py). Errors under these routes are in Anthropic's shape (errors.py).

The `anthropic-version` and `anthropic-beta` headers and the `?beta=true` query that clients send
are accepted: the fields they enable are those messages_schemas.py reads.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.access import report_usage
from gpu_service.api.chat_request import check_messages, prepare_chat, render, start_chat
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import invalid
from gpu_service.api.event_stream import drain, stream_events
from gpu_service.api.messages_input import chat_request
from gpu_service.api.messages_output import MessageBuilder
from gpu_service.api.messages_schemas import MessagesBase, MessagesRequest
from gpu_service.api.parsing import parse_body


def check_body(ctx: ApiContext, body: MessagesBase) -> None:
    ctx.check_model(body.model)
    found = body.unsupported()
    if found is not None:
        raise invalid(found[1], param=found[0])


async def create_message(request: Request, ctx: ApiContext) -> Response:
    body = await parse_body(request, MessagesRequest)
    check_body(ctx, body)
    prepared = await prepare_chat(ctx, chat_request(body))
    builder = MessageBuilder(ctx.model_name, prepared.reader())
    (generation,) = await start_chat(request, ctx, prepared, builder.id)
    if body.stream:
        return await stream_events(request, generation, builder)
    await drain(request, generation, builder)
    return JSONResponse(builder.message())


async def count_message_tokens(request: Request, ctx: ApiContext) -> Response:
    """The prompt's tokens as /v1/messages would render it: {"input_tokens": N}."""
    body = await parse_body(request, MessagesBase)
    check_body(ctx, body)
    req = chat_request(body)
    check_messages(req.messages)
    ids, _ = await render(ctx, req.messages, req.tools, req.template_kwargs, req.thinking)
    report_usage(request.scope, len(ids), 0)
    return JSONResponse({"input_tokens": len(ids)})
