"""Request bodies of the OpenAI API, as pydantic models.

Parsed strictly from JSON (a string where a number belongs is a 400, not a silent conversion).
Fields this server does not know are accepted and ignored, as clients send new ones all the time;
known fields it cannot honour are refused by `unsupported()` with a message naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpu_service.engine.sampling import MAX_TOP_LOGPROBS


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
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
        return message


class _Sampling(_Body):
    """Fields chat and completions share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension: sample among the k most likely tokens")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    timeout: float | None = Field(None, gt=0, description="extension: seconds until it ends")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        if self.n != 1:
            return "n", f"n={self.n} is not supported: this server returns one choice (n=1)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                return name, f"{name} is not supported (use 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is not None:
            return found
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only response_format type 'text' is supported"
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
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
