"""What the HTTP handlers need from the server: the engine, the tokenizer, limits, health.

Prompts are checked by the engine itself (engine/validation.py) when a Generation adds them; text
is tokenized on one thread of its own (never the event loop's), after a bound on its length that
costs nothing has refused what cannot fit."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpu_service.api.admission import Admission
from gpu_service.api.errors import ApiError, from_engine
from gpu_service.api.generation import Generation, unless_disconnected
from gpu_service.api.tokenizer import ServedTokenizer
from gpu_service.api.tool_parsers import ToolParser
from gpu_service.engine import Engine, EngineError, SamplingParams
from gpu_service.engine.errors import EngineStopped
from gpu_service.engine.grammar import GrammarCompiler


@dataclass
class ApiContext:
    """engine: a started Engine. model_name: the `model` clients must send. max_model_len: the
    context length. api_key: required when set (auth.py says where). registries: Prometheus
    registries served on /metrics (the engine's first). worker_status: each expert worker's state
    for /health (dicts with at least "address" and "alive"). request_timeout_s: every request's
    deadline (None: only those that send `timeout` have one). max_request_bytes: the body's bound
    (413); request_read_timeout_s: its time to arrive (408). metrics_public: /metrics needs no key.
    admission: the in-flight bound and the draining flag (admission.py). generations: those not yet
    closed. tool_parser: how tool calls are written and read (None: tools are refused).
    reasoning_parser: a REASONING_PARSERS name (None: no split). grammars: compiles the grammars of
    constrained decoding (None: it is refused). access_log: a log line per request (access.py).
    max_stored_responses: /v1/responses kept for previous_response_id (0: none)."""

    engine: Engine
    tokenizer: ServedTokenizer
    model_name: str
    max_model_len: int
    worker_status: Callable[[], list[dict]]
    api_key: str | None = None
    registries: Sequence[CollectorRegistry] = ()
    request_timeout_s: float | None = None
    max_request_bytes: int = 8 << 20
    request_read_timeout_s: float = 60.0
    metrics_public: bool = False
    admission: Admission = field(default_factory=Admission)
    tool_parser: ToolParser | None = None
    reasoning_parser: str | None = None
    grammars: GrammarCompiler | None = None
    access_log: bool = True
    max_stored_responses: int = 1024
    created: int = field(default_factory=lambda: int(time.time()))
    generations: weakref.WeakSet[Generation] = field(default_factory=weakref.WeakSet)
    _tokenize: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ktserve-tokenize")
    )

    async def encode_prompt(self, text: str, param: str = "prompt",
                            add_special_tokens: bool = True) -> list[int]:  # fmt: skip
        """text's ids, tokenized off the event loop once the length bound let it through."""
        try:
            self.tokenizer.check_length(len(text), self.max_model_len)
        except EngineError as exc:
            raise from_engine(exc, param) from exc
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(self, messages: Callable[[bool], list[dict]],
                          tools: list[dict] | None = None, template_kwargs: dict | None = None,
                          param: str = "messages") -> tuple[list[int], str]:  # fmt: skip
        """The conversation's prompt ids and text (ServedTokenizer.render_chat) off the event
        loop."""
        try:
            return await self._off_loop(self.tokenizer.render_chat, messages, tools,
                                        template_kwargs, self.max_model_len)  # fmt: skip
        except EngineError as exc:
            raise from_engine(exc, param) from exc

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, *args)

    def generation(self, body: Any, prompt_ids: Sequence[int], params: SamplingParams,
                   request_id: str, prompt_param: str) -> Generation:  # fmt: skip
        """The request in the engine, with its deadline: the body's `timeout` or the server's,
        whichever is shorter."""
        if self.admission.draining:
            raise from_engine(EngineStopped("the server is shutting down"))
        timeouts = [t for t in (getattr(body, "timeout", None), self.request_timeout_s) if t]
        generation = Generation(self.engine, prompt_ids, params, request_id, prompt_param,
                                timeout_s=min(timeouts, default=None))  # fmt: skip
        self.generations.add(generation)
        return generation

    async def choices(self, request: Any, body: Any, prompt_ids: Sequence[int],
                      params: Sequence[SamplingParams], request_id: str,
                      prompt_param: str) -> list[Generation]:  # fmt: skip
        """One generation per choice (params[i] for choice i; engine ids request_id-i when more
        than one). With prefix caching, choices after the first are added once the first has
        its prompt in the KV cache (its first event), so they find the prompt's full blocks
        there instead of each computing them (the expert calls included). If the engine
        refuses one, or the client leaves meanwhile, those already added are closed. Observes
        ktserve_request_params_n once all are in."""
        out: list[Generation] = []
        try:
            for i, p in enumerate(params):
                rid = request_id if len(params) == 1 else f"{request_id}-{i}"
                out.append(self.generation(body, prompt_ids, p, rid, prompt_param))
                if i == 0 and len(params) > 1 and self._shares_prompt(prompt_ids):
                    await unless_disconnected(request, out[0].started.wait())
        except BaseException:
            for generation in out:
                generation.close()
            raise
        self.engine.metrics.request_n.observe(len(params))
        return out

    def _shares_prompt(self, prompt_ids: Sequence[int]) -> bool:
        kv = getattr(getattr(self.engine, "scheduler", None), "kv_manager", None)
        return bool(kv is not None and kv.prefix_caching
                    and len(prompt_ids) >= kv.block_size)  # fmt: skip

    def end_generations(self, error: EngineError) -> int:
        """End every generation still open with `error` (Generation.end); how many there were."""
        open_ = [g for g in list(self.generations) if not g.finished]
        for generation in open_:
            generation.end(error)
        return len(open_)

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
