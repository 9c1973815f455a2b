"""What the HTTP handlers need from the server: the engine, the tokenizer, limits, health.

Prompts are checked by the engine itself (engine/validation.py) when a Generation adds them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from gpu_service.api.errors import ApiError
from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.api.tool_parsers import ToolParser
from gpu_service.engine import Engine
from gpu_service.engine.grammar import GrammarCompiler


@dataclass
class ApiContext:
    """engine: a started Engine. model_name: the `model` clients must send. max_model_len: the
    context length. api_key: required on /v1/* when set. registries: Prometheus registries served
    on /metrics (the engine's first). worker_status: each expert worker's state for /health
    (dicts with at least "address" and "alive"). tool_parser: how tool calls are written and read
    (None: tools are refused). reasoning_parser: a REASONING_PARSERS name (None: no split).
    grammars: compiles the grammars of constrained decoding (None: it is refused)."""

    engine: Engine
    tokenizer: ServedTokenizer
    model_name: str
    max_model_len: int
    worker_status: Callable[[], list[dict]]
    api_key: str | None = None
    registries: Sequence[CollectorRegistry] = ()
    tool_parser: ToolParser | None = None
    reasoning_parser: str | None = None
    grammars: GrammarCompiler | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def max_tokens_for(self, prompt_ids: Sequence[int], requested: int | None) -> int:
        """requested, or the room left in the context (the engine stops at its end anyway; it
        refuses a prompt that leaves no room, so that one asks for 1)."""
        room = max(self.max_model_len - len(prompt_ids), 1)
        return room if requested is None else requested
