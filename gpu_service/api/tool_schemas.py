"""Request parts of tool calling and structured outputs (OpenAI's shapes), as pydantic models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class FunctionDef(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Part):
    name: str
    arguments: str


class MessageToolCall(_Part):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class JsonSchemaFormat(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
