"""A Responses API request as the internal ChatRequest (chat_request.py).

instructions                    a system message first (not carried to later turns)
input: string                   one user message
input: message items            their text parts joined (role developer: system)
input: function_call items      tool_calls of the assistant message they follow (or a new one)
input: function_call_output     a tool message answering call_id
input: reasoning items          reasoning_content of the next assistant message
tools: function tools           chat tools (a namespace's function tools too: their calls
                                name the namespace); any other type is a 400 naming it
tool_choice {type function}     a named tool choice
text.format                     response_format json_object / json_schema
reasoning.effort                the template's thinking switch: none/minimal off, else on
"""

from __future__ import annotations

from gpu_service.api.chat_request import ChatRequest
from gpu_service.api.errors import invalid
from gpu_service.api.parsing import SamplingFields
from gpu_service.api.responses_schemas import (
    TEXT_PARTS,
    ContentPart,
    ResponsesRequest,
    ResponsesTool,
)
from gpu_service.api.schemas import ChatMessage, logit_bias_ids
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

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def text_of(parts: str | list[ContentPart] | None, param: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    kinds = sorted({p.type for p in parts if p.type not in TEXT_PARTS})
    if kinds:
        raise invalid(f"only text content is supported, got parts of type {kinds}", param=param)
    return "".join(p.text or p.refusal or "" for p in parts)


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The input as chat messages (instructions not included)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    out: list[ChatMessage] = []
    reasoning: str | None = None

    def assistant() -> ChatMessage:
        """The assistant message a call or a reasoning joins: the last one, if it ends the list."""
        nonlocal reasoning
        if not out or out[-1].role != "assistant":
            out.append(ChatMessage(role="assistant", content=None))
        if reasoning is not None:
            out[-1].reasoning_content, reasoning = reasoning, None
        return out[-1]

    for i, item in enumerate(body.input):
        param = f"input.{i}"
        kind = item.type or ("message" if item.role else None)
        if item.encrypted_content is not None:
            raise invalid("encrypted reasoning is not supported (this server never writes it)",
                          param=f"{param}.encrypted_content")  # fmt: skip
        if kind == "message":
            if item.role is None:
                raise invalid("a message item needs a role", param=f"{param}.role")
            text = text_of(item.content, f"{param}.content")
            if item.role == "assistant":
                message = assistant()
                message.content = (message.content or "") + text
            else:
                role = "system" if item.role == "developer" else item.role
                out.append(ChatMessage(role=role, content=text))
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise invalid("a function_call item needs call_id, name and arguments",
                              param=param)  # fmt: skip
            message = assistant()
            call = MessageToolCall(id=item.call_id,
                                   function=CalledFunction(name=item.name,
                                                           arguments=item.arguments))  # fmt: skip
            message.tool_calls = [*(message.tool_calls or []), call]
        elif kind == "function_call_output":
            if not item.call_id:
                raise invalid("a function_call_output item needs call_id", param=f"{param}.call_id")
            output = text_of(item.output, f"{param}.output")
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
        elif kind == "reasoning":
            parts = item.content if item.content else item.summary
            reasoning = text_of(parts, f"{param}.content")
        else:
            raise invalid(
                f"input items of type {kind!r} are not supported: message, function_call, "
                "function_call_output and reasoning are",
                param=f"{param}.type",
            )
    return out


def tools_of(body: ResponsesRequest) -> tuple[list[Tool], dict[str, str]]:
    """The function tools, and the namespace of each that is in one (by name)."""
    tools, namespaces = [], {}
    for i, t in enumerate(body.tools or []):
        if t.type == "namespace" and t.name:
            for j, inner in enumerate(t.tools or []):
                tools.append(_function(inner, f"tools.{i}.tools.{j}"))
                namespaces[inner.name] = t.name
            continue
        tools.append(_function(t, f"tools.{i}"))
    return tools, namespaces


def _function(t: ResponsesTool, param: str) -> Tool:
    if t.type != "function":
        raise invalid(
            f"tools of type {t.type!r} are not supported by this server: only function tools "
            "(and namespaces of them)",
            param=f"{param}.type",
        )
    if not t.name:
        raise invalid("a function tool needs a name", param=f"{param}.name")
    try:
        function = FunctionDef(name=t.name, description=t.description,
                               parameters=t.parameters, strict=t.strict)  # fmt: skip
    except ValueError:
        raise invalid(f"tool name {t.name!r} must match ^[a-zA-Z0-9_.-]{{1,64}}$",
                      param=f"{param}.name") from None  # fmt: skip
    return Tool(type="function", function=function)


def tool_choice_of(body: ResponsesRequest):
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise invalid(
            f"tool_choice of type {choice.type!r} is not supported: none, auto, required or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
        )
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))


def format_of(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type) if fmt is not None else None
    try:
        schema = JsonSchemaFormat(name=fmt.name or "response", description=fmt.description,
                                  schema=fmt.schema_, strict=fmt.strict)  # fmt: skip
    except ValueError:
        raise invalid(f"text.format name {fmt.name!r} must match ^[a-zA-Z0-9_-]{{1,64}}$",
                      param="text.format.name") from None  # fmt: skip
    return ResponseFormat(type="json_schema", json_schema=schema)


def thinking_of(body: ResponsesRequest) -> bool | None:
    effort = body.reasoning.effort if body.reasoning is not None else None
    return None if effort is None else effort not in ("none", "minimal")


def _logit_bias(body: ResponsesRequest) -> tuple[tuple[int, float], ...]:
    try:
        return logit_bias_ids(body.logit_bias)
    except ValueError as exc:
        raise invalid(str(exc), param="logit_bias") from exc


def chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> ChatRequest:
    """The internal request: history (previous_response_id's conversation), then the input."""
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    logprobs = LOGPROBS_INCLUDE in (body.include or ()) or bool(body.top_logprobs)
    return ChatRequest(
        messages=[*system, *history, *input_messages(body)],
        sampling=SamplingFields(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            logit_bias=_logit_bias(body),
        ),
        max_tokens=body.max_output_tokens,
        tools=tools_of(body)[0],
        tool_choice=tool_choice_of(body),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=format_of(body),
        template_kwargs=body.chat_template_kwargs or {},
        thinking=thinking_of(body),
        logprobs=logprobs,
        top_logprobs=body.top_logprobs or 0,
        timeout=body.timeout,
        messages_param="input",
        format_param="text.format",
    )
