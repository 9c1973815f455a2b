"""Request bodies of the OpenAI API, as pydantic models.

Parsed strictly from JSON (a string where a number belongs is a 400, not a silent conversion).
Nothing is silently ignored: a field this server does not know, set to anything but null, is a
400 naming it (`unknown_fields()`, nested objects included), and known fields it cannot honour
are refused by `unsupported()` with a message naming them. Accepted without effect on the output:
`user`, `safety_identifier` and `prompt_cache_key` (identifiers; the prefix cache needs no key),
`store: false`, `modalities: ["text"]`, `service_tier` auto/default.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpu_service.api.tool_schemas import MessageToolCall, NamedToolChoice, ResponseFormat, Tool
from gpu_service.engine.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 16  # choices per request (each is a sequence of the running batch)
# NOTE: every integer field is bounded here, where it is parsed (a 400 naming it), never by a
# C conversion further on (a 500): seeds are signed 64-bit (OpenAI's), counts fit 32 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COUNT = 2**31 - 1


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """The paths (messages.0.audio) of fields set to non-null values that no model here
        declares, in nested bodies too."""
        found = [f"{prefix}{k}" for k, v in (self.model_extra or {}).items() if v is not None]
        for name in type(self).model_fields:
            found += _unknown_in(getattr(self, name), f"{prefix}{name}.")
        return found


def _unknown_in(value: Any, prefix: str) -> list[str]:
    if isinstance(value, _Body):
        return value.unknown_fields(prefix)
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _unknown_in(v, f"{prefix}{i}.")]
    return []


def logit_bias_ids(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """logit_bias with its keys (token ids as JSON strings) as ints; ValueError if one is not an
    id."""
    out = []
    for key, bias in (logit_bias or {}).items():
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        out.append((int(key), bias))
    return tuple(out)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_template(self, arguments_as_text: bool = False) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string; tool calls with
        their arguments as objects (as Hugging Face templates take them), or as the JSON text
        OpenAI sends (templates that concatenate them, such as DeepSeek's)."""
        if isinstance(self.content, list):
            kinds = sorted({p.type for p in self.content if p.type != "text"})
            if kinds:
                raise ValueError(f"only text content is supported, got parts of type {kinds}")
            content = "".join(p.text or "" for p in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments
                        if arguments_as_text
                        else _arguments(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"tool call arguments are not JSON: {text[:80]!r}") from None


class _Sampling(_Body):
    """Fields chat and completions share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # identifiers that do not change the output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # accepted only where they ask for what this server does anyway
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] | None = None
    # extensions (vLLM's names)
    top_k: int = Field(
        0, ge=-1, le=MAX_COUNT, description="extension: sample among the k most likely tokens"
    )
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # checked against the vocabulary by the engine
    timeout: float | None = Field(None, gt=0, description="extension: seconds until it ends")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
        return logit_bias_ids(self.logit_bias)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        unknown = self.unknown_fields()
        if unknown:
            return unknown[0], (
                f"{unknown[0]} is not supported by this server (a field it does not know; "
                "remove it or send null)"
            )
        if self.store:
            return "store", "store is not supported: this server keeps no completions"
        if self.metadata:
            return "metadata", "metadata is for stored completions; this server keeps none"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", f"service_tier {self.service_tier!r} is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # extension (vLLM's name): extra variables for the chat template, e.g. enable_thinking
    chat_template_kwargs: dict[str, Any] | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated predecessors of tools: refused
    function_call: Any = None
    reasoning_effort: str | None = None  # refused: thinking is the template's (enable_thinking)
    modalities: list[str] | None = None  # ["text"] only

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is not None:
            return found
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            return name, f"{name} is deprecated and not supported: use tools and tool_choice"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", 'only text output is supported: modalities ["text"]'
        if self.reasoning_effort is not None:
            return "reasoning_effort", (
                "reasoning_effort is not supported; whether the model thinks is up to its chat "
                'template: e.g. chat_template_kwargs {"enable_thinking": false}'
            )
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # ids: checked by the engine
    max_tokens: int | None = Field(16, ge=1, le=MAX_COUNT)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is not None:
            return found
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
            return "prompt", "one prompt per request is supported, got a batch"
        return None

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids (a batch of one unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt
