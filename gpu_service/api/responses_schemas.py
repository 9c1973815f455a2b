"""Request bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models.

As schemas.py's: strict, and a field this server does not know set to anything but null is a 400
naming it. Accepted without effect on the output: `user`, `safety_identifier`,
`prompt_cache_key`, `prompt_cache_retention`, `client_metadata`, `include` (what it selects is
either returned anyway or belongs to tools this server has not), `text.verbosity`,
`reasoning.summary`, `service_tier` auto/default, `stream_options`; `metadata` is echoed back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gpu_service.api.schemas import INT64_MAX, INT64_MIN, MAX_COUNT, _Body
from gpu_service.engine.sampling_params import MAX_TOP_LOGPROBS

TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text", "refusal")


class ContentPart(_Body):
    """A part of a message's (or reasoning item's) content; only text parts are supported."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # of output_text given back: ignored
    logprobs: list[Any] | None = None


class InputItem(_Body):
    """One input item: a message (typed or the short {role, content}), a function_call, a
    function_call_output, or a reasoning item given back."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None  # never written here, so refused when given
    phase: str | None = None
    namespace: str | None = None  # of a function_call: its tool's namespace


class ResponsesTool(_Body):
    """A function tool, or a namespace of them (type namespace: its `tools`)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[ResponsesTool] | None = None


class NamedFunction(_Body):
    type: str
    name: str | None = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Body):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # default true: kept for previous_response_id (bounded)
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_COUNT)
    # identifiers that do not change the output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    client_metadata: dict[str, Any] | None = None
    # refused when set: stored prompts, conversations
    prompt: Any = None
    conversation: Any = None
    # extensions (vLLM's names)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int = Field(0, ge=-1, le=MAX_COUNT)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    timeout: float | None = Field(None, gt=0)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        unknown = self.unknown_fields()
        if unknown:
            return unknown[0], (
                f"{unknown[0]} is not supported by this server (a field it does not know; "
                "remove it or send null)"
            )
        if self.background:
            return "background", "background responses are not supported"
        if self.prompt is not None:
            return "prompt", "stored prompts are not supported: send input and instructions"
        if self.conversation is not None:
            return "conversation", (
                "conversations are not supported: use previous_response_id or send the whole input"
            )
        if self.truncation == "auto":
            return "truncation", "truncation auto is not supported: a too long input is a 400"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", f"service_tier {self.service_tier!r} is not supported"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls is)"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None


ResponsesTool.model_rebuild()
