"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}: the body as the
internal ChatRequest (responses_input.py), its output as output items and events
(responses_output.py).

Responses are kept (unless store is false) for previous_response_id: at most
--max-stored-responses of them, each for STORE_TTL_S; a later request that names one continues
its conversation (its input and output; not its instructions, as OpenAI does).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gpu_service.api.chat_request import prepare_chat, start_chat
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import ApiError, invalid
from gpu_service.api.event_stream import drain, stream_events
from gpu_service.api.parsing import parse_body
from gpu_service.api.responses_input import chat_request, input_messages, tools_of
from gpu_service.api.responses_output import ResponseBuilder, new_id
from gpu_service.api.responses_schemas import ResponsesRequest
from gpu_service.api.schemas import ChatMessage
from gpu_service.api.tool_schemas import CalledFunction, MessageToolCall

STORE_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: dict
    conversation: list[ChatMessage]  # input and output, instructions left out
    expires: float


class ResponseStore:
    """At most `capacity` responses (the oldest go first), each for ttl_s seconds."""

    def __init__(self, capacity: int, ttl_s: float = STORE_TTL_S) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, conversation: list[ChatMessage]) -> None:
        if self.capacity <= 0:
            return
        self._expire()
        self._kept[response["id"]] = StoredResponse(response, conversation,
                                                    time.monotonic() + self.ttl_s)  # fmt: skip
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._kept.get(response_id)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._kept.popitem(last=False)


def output_messages(items: list[dict]) -> list[ChatMessage]:
    """A response's output items as the assistant's turn in a conversation."""
    message = ChatMessage(role="assistant", content=None)
    for item in items:
        if item["type"] == "reasoning":
            message.reasoning_content = item["content"][0]["text"] if item["content"] else ""
        elif item["type"] == "message":
            message.content = (message.content or "") + item["content"][0]["text"]
        elif item["type"] == "function_call":
            call = MessageToolCall(id=item["call_id"], function=CalledFunction(
                name=item["name"], arguments=item["arguments"]))  # fmt: skip
            message.tool_calls = [*(message.tool_calls or []), call]
    return [message]


def echo(body: ResponsesRequest, stored: bool) -> dict:
    """The request's fields a Response repeats."""
    reasoning = body.reasoning
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },  # fmt: skip
        "store": stored,
        "temperature": body.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },  # fmt: skip
        "tool_choice": choice.model_dump(exclude_none=True)
        if choice and not isinstance(choice, str)
        else (choice or "auto"),  # fmt: skip
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


async def create_response(request: Request, ctx: ApiContext, store: ResponseStore) -> Response:
    body = await parse_body(request, ResponsesRequest)
    ctx.check_model(body.model)
    found = body.unsupported()
    if found is not None:
        raise invalid(found[1], param=found[0])
    if body.store and store.capacity <= 0:
        raise invalid("store is off on this server (--max-stored-responses 0): send store false",
                      param="store")  # fmt: skip
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise invalid(
                f"previous response {body.previous_response_id!r} is not found: responses are "
                f"kept {store.ttl_s:g} s, at most {store.capacity} of them, and only with store "
                "true",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = previous.conversation
    req = chat_request(body, history)
    prepared = await prepare_chat(ctx, req)
    response_id = new_id("resp")
    (generation,) = await start_chat(request, ctx, prepared, response_id)
    stored = body.store is not False and store.capacity > 0
    builder = ResponseBuilder(response_id, ctx.model_name, echo(body, stored), prepared.reader(),
                              ctx.tokenizer if req.logprobs else None,
                              namespaces=tools_of(body)[1])  # fmt: skip
    if stored:
        conversation = [*history, *input_messages(body)]
        builder.on_done = lambda r: store.put(r, [*conversation, *output_messages(r["output"])])
    if body.stream:
        return await stream_events(request, generation, builder)
    await drain(request, generation, builder)
    return JSONResponse(builder.response())


def get_response(store: ResponseStore, response_id: str) -> Response:
    kept = store.get(response_id)
    if kept is None:
        raise ApiError(404, f"no stored response {response_id!r}", param="response_id",
                       code="not_found")  # fmt: skip
    return JSONResponse(kept.response)
