"""A request's life inside the engine.

WAITING --admit (KV blocks for the prompt)--> RUNNING --finish--> FINISHED
   ^                                             |
   +------- preempted (KV cache full) -----------+   (recomputed from prompt + output)
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field

import torch

from gpu_service.engine.errors import EngineError
from gpu_service.engine.grammar import GrammarMatcher
from gpu_service.engine.logits_processors import TokenHistory
from gpu_service.engine.sampling import SampledToken, SamplingParams
from gpu_service.kvcache.sequence import SeqCache


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed the request (e.g. expert workers unavailable)


@dataclass(frozen=True)
class TokenEvent:
    """What the engine reports after each step for a request: new tokens, or the end. An end
    with finish_reason ERROR or ABORT carries the error that ended it."""

    request_id: str
    tokens: tuple[SampledToken, ...]
    text: str = ""
    finish_reason: FinishReason | None = None
    error: EngineError | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache (not computed)
    stop_string: str | None = None  # of an end: the stop string that ended the output


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output: list[SampledToken] = field(default_factory=list)  # add_output appends
    cache: SeqCache | None = None
    finish_reason: FinishReason | None = None
    error: EngineError | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_prompt_tokens: int | None = None  # found in the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of all_ids's full blocks, chained
    generator: torch.Generator = field(init=False)
    matcher: GrammarMatcher | None = field(init=False, default=None)  # with params.grammar
    history: TokenHistory | None = field(init=False, default=None)  # penalties' counts (runner)
    output_ids: list[int] = field(init=False)  # the output's token ids, kept with it (add_output)

    def __post_init__(self) -> None:
        self.output_ids = [t.token_id for t in self.output]
        if self.params.grammar is not None:
            self.matcher = self.params.grammar.matcher()
        seed = self.params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)

    def add_output(self, token: SampledToken) -> None:
        self.output.append(token)
        self.output_ids.append(token.token_id)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end], without building all_ids: a decode step reads one id of a
        context of tens of thousands (building it would cost a copy of the context per request
        and step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output)

    @property
    def num_cached(self) -> int:
        return self.cache.num_tokens if self.cache is not None else 0

    @property
    def finished(self) -> bool:
        return self.state == RequestState.FINISHED
