"""A request's sampling parameters, checked where they are built (the sampler: sampling.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_service.engine.grammar import Grammar

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0, top_p 1 and min_p 0 disable those filters (min_p keeps
    the tokens at least min_p times as likely as the most likely one). seed makes a request
    reproducible whatever else runs beside it. Generation stops at max_tokens, at an EOS (unless
    ignore_eos), at any of stop_token_ids, or at any of the stop strings (which are not returned);
    before min_tokens tokens, EOS and stop_token_ids cannot be sampled.
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]) are subtracted from the logits of
    tokens already generated (once / per occurrence); repetition_penalty (> 0, 1 is none; as
    transformers does it) divides positive logits and multiplies negative ones of every token in
    the prompt or the output. logit_bias: (token id, bias in [-100, 100]) added to the logits.
    logprobs: return each sampled token's logprob (of the model's distribution, before the
    penalties and filters) and the top_logprobs most likely alternatives.
    grammar: a compiled grammar (grammar.py) the output must follow (constrained decoding).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )
