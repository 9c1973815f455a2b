"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens),
as pydantic models.

As schemas.py's: strict, and a field this server does not know set to anything but null is a 400
naming it. Accepted on purpose without effect (nothing to do locally): `cache_control` (on the
request, its blocks and tools: the prefix cache needs no marks), `context_management`,
`output_config.effort`, `service_tier`, `metadata`, `inference_geo`, `speed`,
`thinking.budget_tokens`, `citations` on text blocks, redacted thinking blocks given back
(nothing to render).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gpu_service.api.schemas import MAX_COUNT, _Body


class Block(_Body):
    """A content block of a message: text, tool_use, tool_result, thinking, redacted_thinking
    (images and documents are refused by type)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted thinking: accepted, not rendered
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation instruction
    content: str | list[Block]


class AnthropicTool(_Body):
    type: str | None = None  # custom (or absent); server tools are refused by type
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)
    display: str | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class OutputConfig(_Body):
    effort: str | None = None
    format: OutputFormat | None = None


class MessagesBase(_Body):
    """What count_tokens takes: the conversation and what shapes its prompt."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None  # refused when set
    container: Any = None  # refused when set

    def unsupported(self) -> tuple[str, str] | None:
        unknown = self.unknown_fields()
        if unknown:
            return unknown[0], (
                f"{unknown[0]} is not supported by this server (a field it does not know; "
                "remove it or send null)"
            )
        if self.mcp_servers:
            return "mcp_servers", "MCP servers are not supported by this server"
        if self.container is not None:
            return "container", "containers are not supported by this server"
        return None


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_COUNT)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    timeout: float | None = Field(None, gt=0, description="extension: seconds until it ends")

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is None and self.service_tier not in (None, "auto", "standard_only"):
            return "service_tier", f"service_tier {self.service_tier!r} is not supported"
        return found


Block.model_rebuild()
