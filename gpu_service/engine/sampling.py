"""The sampler: one step's rows sampled together on the model's device (parameters:
sampling_params.py).

    logits [B, V]  (grammar masks applied: runner.py)
      -> min_tokens, logit_bias, repetition / frequency / presence penalties   (logits_processors)
      -> greedy rows: argmax
      -> temperature -> min_p -> top_k -> top_p -> softmax
      -> one uniform draw per row from its own generator (CPU, seeded), inverse CDF on the device

Every filter is one batched op over the rows (each row's value a column of a [B, 1] tensor), so a
step costs the same few kernels whatever its rows ask for. A row's draw depends only on its
generator and its own logits: a seeded request gives the same tokens whatever runs beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gpu_service.engine.logits_processors import LogitsInput, process_logits, to_device
from gpu_service.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Samples one token per row of logits [B, V], each row with its own params and generator.
    eos_token_ids: what min_tokens holds back (with each row's stop_token_ids)."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[SampledToken]:
        """prompt_ids / output_ids: each row's tokens so far (for penalties and min_tokens;
        None: none yet)."""
        raw = logits.float()  # [B, V]
        empty: list[Sequence[int]] = [()] * raw.shape[0]
        rows = LogitsInput.from_ids(params, prompt_ids or empty, output_ids or empty,
                                    raw.shape[1], raw.device, self.eos_token_ids)  # fmt: skip
        return self.sample_rows(raw, rows, generators)

    def sample_rows(
        self,
        logits: torch.Tensor,
        rows: LogitsInput,
        generators: Sequence[torch.Generator | None],
    ) -> list[SampledToken]:
        """As __call__, with the rows' history already on the device (LogitsInput)."""
        raw = logits.float()
        tokens = self.sample_ids(raw, rows, generators).tolist()
        return _with_logprobs(raw, tokens, rows.params)

    def sample_ids(
        self,
        logits: torch.Tensor,
        rows: LogitsInput,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """The rows' token ids (int64 [B], on logits' device), nothing waited for on the host
        (on CUDA every host value goes through pinned memory)."""
        raw = logits.float()
        if not rows.eos_token_ids and self.eos_token_ids:
            rows = replace(rows, eos_token_ids=self.eos_token_ids)
        processed = process_logits(raw, rows)
        if processed is not raw:
            # NOTE: a row left with no token (min_tokens holding back the EOS that is all its
            # grammar allows) samples from its logits as they came instead.
            dead = torch.isinf(processed).all(dim=-1, keepdim=True)  # [B, 1]
            processed = torch.where(dead, raw, processed)
        return sample(processed, rows.params, generators)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token id per row of processed logits [B, V] (int64 [B], on logits' device)."""
    device = logits.device
    greedy = [p.greedy for p in params]
    argmax = logits.argmax(dim=-1)  # [B]
    if all(greedy):
        return argmax
    column = _columns(device)
    temperature = column([p.temperature if not p.greedy else 1.0 for p in params])
    scores = logits / temperature  # [B, V]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(scores, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * column([p.min_p for p in params])
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if any(p.top_k or p.top_p < 1 for p in params):
        scores = _top_k_top_p(scores, params, column)
    probs = torch.softmax(scores, dim=-1)  # [B, V]
    # NOTE: the first token whose cumulative mass exceeds u * total: never a zero-mass token.
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    u = column([float(torch.rand(1, generator=g)) for g in generators], torch.float64)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # [B]
    drawn = drawn.clamp_(max=logits.shape[1] - 1)
    return torch.where(to_device(torch.tensor(greedy), device), argmax, drawn)


def _top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams], column) -> torch.Tensor:
    """top_k (ties with the k-th kept) then top_p (the smallest prefix whose mass reaches it,
    always the first token), both on one descending sort."""
    vocab = scores.shape[1]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [B, V]
    k = column([min(p.top_k, vocab) if p.top_k else vocab for p in params], torch.int64)
    kth = sorted_scores.gather(1, k - 1)  # [B, 1]
    sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, float("-inf"))
    probs = torch.softmax(sorted_scores, dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= column([p.top_p for p in params])
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)


def _columns(device: torch.device):
    def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)[:, None]  # [B, 1]

    return column


def _with_logprobs(raw: torch.Tensor, tokens: list[int],
                   params: Sequence[SamplingParams]) -> list[SampledToken]:  # fmt: skip
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return [SampledToken(t) for t in tokens]
    out = [SampledToken(t) for t in tokens]
    logprobs = torch.log_softmax(raw[rows], dim=-1)  # [R, V]
    index = torch.tensor([tokens[i] for i in rows], device=raw.device)[:, None]  # [R, 1]
    picked = logprobs.gather(1, index).squeeze(1).tolist()
    for r, i in enumerate(rows):
        top = ()
        if params[i].top_logprobs:
            values, indices = torch.topk(logprobs[r], params[i].top_logprobs)
            top = tuple(zip(indices.tolist(), values.tolist()))
        out[i] = SampledToken(tokens[i], picked[r], top)
    return out
