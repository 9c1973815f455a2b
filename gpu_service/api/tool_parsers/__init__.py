"""Tool-call parsers, one per format, and the choice of one for a checkpoint.

The choice (unless --tool-call-parser names one): the format the chat template writes (its
markers; the formats that share Hermes' <tool_call> are asked first), else the family's
(config.json model_type)."""

from __future__ import annotations

from gpu_service.api.tool_parsers.base import Extracted, FunctionSpec, ToolCall, ToolParser
from gpu_service.api.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from gpu_service.api.tool_parsers.glm45 import Glm45ToolParser
from gpu_service.api.tool_parsers.hermes import HermesToolParser
from gpu_service.api.tool_parsers.mistral import MistralToolParser
from gpu_service.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from gpu_service.api.tool_parsers.stream import ToolCallStream

# NOTE: in the order choose_tool_parser asks them: GLM's and Qwen3-Coder's before Hermes'
_ORDER = (Glm45ToolParser, Qwen3CoderToolParser, HermesToolParser, DeepSeekV3ToolParser,
          MistralToolParser)  # fmt: skip
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in _ORDER}
BY_MODEL_TYPE = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "qwen3_moe": "hermes",
                 "qwen2_moe": "hermes", "mixtral": "mistral", "glm4_moe": "glm45"}  # fmt: skip


def choose_tool_parser(chat_template: str | None, model_type: str | None) -> str | None:
    """The parser's name for a checkpoint: from its template's markers, else its family."""
    template = chat_template or ""
    for parser in PARSERS.values():
        if parser.writes(template):
            return parser.name
    return BY_MODEL_TYPE.get(model_type or "")


def tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None


__all__ = [
    "PARSERS",
    "Extracted",
    "FunctionSpec",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "choose_tool_parser",
    "tool_parser",
]
