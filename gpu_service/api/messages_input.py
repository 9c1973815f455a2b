"""A Messages API request as the internal ChatRequest (chat_request.py).

system (string or text blocks)        a system message first
user: text blocks                     a user message (their text joined)
user: tool_result blocks              tool messages answering tool_use_id (before the text);
                                      is_error ones start with "Error: "
assistant: thinking blocks            the message's reasoning_content
assistant: text / tool_use blocks     its content / its tool_calls (input as JSON text)
tools (input_schema)                  function tools; tool_choice auto / any (required) /
                                      tool (named) / none; disable_parallel_tool_use
thinking enabled / adaptive / disabled  the template's thinking switch on / on / off
output_config.format json_schema      response_format json_schema
"""

from __future__ import annotations

import json

from gpu_service.api.chat_request import ChatRequest
from gpu_service.api.errors import invalid
from gpu_service.api.messages_schemas import Block, MessagesBase, MessagesRequest
from gpu_service.api.parsing import SamplingFields
from gpu_service.api.schemas import ChatMessage
from gpu_service.api.tool_schemas import (
    CalledFunction,
    FunctionDef,
    FunctionName,
    JsonSchemaFormat,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

ERROR_PREFIX = "Error: "


def block_text(content: str | list[Block] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    kinds = sorted({b.type for b in content if b.type != "text"})
    if kinds:
        raise invalid(f"only text blocks are supported here, got {kinds}", param=param)
    return "".join(b.text or "" for b in content)


def _user(blocks: list[Block], param: str) -> list[ChatMessage]:
    tools, text = [], []
    for j, b in enumerate(blocks):
        if b.type == "tool_result":
            if not b.tool_use_id:
                raise invalid("a tool_result needs tool_use_id", param=f"{param}.{j}.tool_use_id")
            result = block_text(b.content, f"{param}.{j}.content")
            result = ERROR_PREFIX + result if b.is_error else result
            tools.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=result))
        elif b.type == "text":
            text.append(b.text or "")
        else:
            raise invalid(
                f"content blocks of type {b.type!r} are not supported in user messages: text "
                "and tool_result are",
                param=f"{param}.{j}.type",
            )
    user = [ChatMessage(role="user", content="".join(text))] if text else []
    return [*tools, *user]


def _assistant(blocks: list[Block], param: str) -> ChatMessage:
    message = ChatMessage(role="assistant", content=None)
    for j, b in enumerate(blocks):
        if b.type == "text":
            message.content = (message.content or "") + (b.text or "")
        elif b.type == "thinking":
            message.reasoning_content = (message.reasoning_content or "") + (b.thinking or "")
        elif b.type == "redacted_thinking":
            continue  # nothing to render: it never came from this server
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise invalid("a tool_use block needs id and name", param=f"{param}.{j}")
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            function = CalledFunction(name=b.name, arguments=arguments)
            call = MessageToolCall(id=b.id, function=function)
            message.tool_calls = [*(message.tool_calls or []), call]
        else:
            raise invalid(f"content blocks of type {b.type!r} are not supported in assistant "
                          "messages: text, thinking and tool_use are",
                          param=f"{param}.{j}.type")  # fmt: skip
    return message


def chat_messages(body: MessagesBase) -> list[ChatMessage]:
    out = []
    if body.system:
        out.append(ChatMessage(role="system", content=block_text(body.system, "system")))
    for i, m in enumerate(body.messages):
        param = f"messages.{i}.content"
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":
            out.append(ChatMessage(role="system", content=block_text(m.content, param)))
        elif m.role == "user":
            out += _user(blocks, param)
        else:
            out.append(_assistant(blocks, param))
    return out


def tools_of(body: MessagesBase) -> list[Tool]:
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.type not in (None, "custom"):
            raise invalid(f"tools of type {t.type!r} are not supported by this server: only "
                          "custom tools (name, input_schema)", param=f"tools.{i}.type")  # fmt: skip
        try:
            function = FunctionDef(name=t.name, description=t.description,
                                   parameters=t.input_schema, strict=t.strict)  # fmt: skip
        except ValueError:
            raise invalid(f"tool name {t.name!r} must match ^[a-zA-Z0-9_.-]{{1,64}}$",
                          param=f"tools.{i}.name") from None  # fmt: skip
        tools.append(Tool(type="function", function=function))
    return tools


def tool_choice_of(body: MessagesBase):
    """(tool_choice, parallel_tool_calls) in chat's terms."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise invalid("tool_choice of type tool needs name", param="tool_choice.name")
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name)), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def thinking_of(body: MessagesBase) -> bool | None:
    return None if body.thinking is None else body.thinking.type != "disabled"


def format_of(body: MessagesBase) -> ResponseFormat | None:
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    schema = JsonSchemaFormat(name="output", schema=fmt.schema_)
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(body: MessagesBase) -> ChatRequest:
    tool_choice, parallel = tool_choice_of(body)
    tools = tools_of(body)
    if tool_choice == "none" and not tools:
        tool_choice = None
    req = ChatRequest(
        messages=chat_messages(body),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel if tools else None,
        response_format=format_of(body),
        thinking=thinking_of(body),
        format_param="output_config.format",
    )
    if isinstance(body, MessagesRequest):
        req.sampling = SamplingFields(temperature=body.temperature, top_p=body.top_p,
                                      top_k=body.top_k,
                                      stop=tuple(body.stop_sequences or ()))  # fmt: skip
        req.max_tokens = body.max_tokens
        req.timeout = body.timeout
    return req
