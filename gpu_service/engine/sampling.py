"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_service.engine.grammar import Grammar

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 disable those filters. seed makes a request
    reproducible whatever else runs beside it. Generation stops at max_tokens, at an EOS (unless
    ignore_eos), at any of stop_token_ids, or at any of the stop strings (which are not returned).
    logprobs: return each sampled token's logprob and the top_logprobs most likely alternatives.
    grammar: a compiled grammar (grammar.py) the output must follow (constrained decoding).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
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
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Samples one token per row of logits [B, V] with each row's own params and generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[SampledToken]:
        logits = logits.float()  # [B, V]
        out = []
        for row, p, gen in zip(logits, params, generators):
            token = self._pick(row, p, gen)
            logprob, top = None, ()
            if p.logprobs:
                logprobs = torch.log_softmax(row, dim=-1)  # [V]
                logprob = float(logprobs[token])
                if p.top_logprobs:
                    values, indices = torch.topk(logprobs, p.top_logprobs)
                    top = tuple(zip(indices.tolist(), values.tolist()))
            out.append(SampledToken(token, logprob, top))
        return out

    @staticmethod
    def _pick(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        if p.greedy:
            return int(torch.argmax(row))
        scores = row / p.temperature  # [V]
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.shape[0])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # NOTE: keep the smallest prefix whose mass reaches top_p (always the first token).
            drop = probs.cumsum(-1) - probs >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        return int(torch.multinomial(probs, 1, generator=gen))
