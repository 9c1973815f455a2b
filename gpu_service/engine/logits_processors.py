"""What a request's history does to its logits before sampling, for a whole step at once:

    min_tokens          EOS and stop_token_ids -inf while the output is shorter
    logit_bias          + bias at the given token ids
    repetition_penalty  tokens of the prompt or output: logit / p where > 0, logit * p elsewhere
    frequency_penalty   - f * (times the token was generated)
    presence_penalty    - p * (1 if it was generated at all)

Each is one op on [B, V] (the rows' values as [B, 1] columns), and runs only when some row of
the step asks for it. The counts come as [B, V] tensors on the device: a request's
TokenHistory keeps its own row there and adds only the tokens sampled since the last step, so a
long prompt or output is never copied again (LogitsInput.from_ids builds them from id lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_service.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsInput:
    """Per row: its params and output length; output_counts [B, V] (times each token was
    generated) and prompt_seen [B, V] bool (in the prompt), None where no row needs them; the
    model's EOS ids (what min_tokens holds back)."""

    params: Sequence[SamplingParams]
    num_output: Sequence[int]
    output_counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None
    eos_token_ids: Sequence[int] = ()

    @classmethod
    def from_ids(cls, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                 output_ids: Sequence[Sequence[int]], vocab: int, device: torch.device,
                 eos_token_ids: Sequence[int] = ()) -> LogitsInput:  # fmt: skip
        counts = seen = None
        if any(p.penalized for p in params):
            counts = token_counts(output_ids, vocab, device)
        if any(p.repetition_penalty != 1 for p in params):
            seen = token_counts(prompt_ids, vocab, device) > 0
        return cls(params, [len(o) for o in output_ids], counts, seen, eos_token_ids)


class TokenHistory:
    """One request's counts on the device, kept up to date with its output."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: torch.device,
                 repetition: bool) -> None:  # fmt: skip
        self.output_counts = torch.zeros(vocab, device=device)  # [V]
        self.prompt_seen = token_counts([prompt_ids], vocab, device)[0] > 0 if repetition else None
        self.num_counted = 0

    def update(self, new_ids: Sequence[int]) -> None:
        """Count the tokens generated since the last update (output[num_counted:])."""
        if new_ids:
            ids = torch.as_tensor(list(new_ids), dtype=torch.int64)
            ids = ids[ids < self.output_counts.shape[0]].to(self.output_counts.device)
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            self.num_counted += len(new_ids)


def process_logits(logits: torch.Tensor, rows: LogitsInput) -> torch.Tensor:
    """The logits [B, V] after min_tokens, logit_bias and the penalties (a new tensor where
    anything applies; `logits` itself is never changed)."""
    params = rows.params
    vocab = logits.shape[1]
    device = logits.device
    cells: list[tuple[int, int, float]] = []  # (row, token, value) for one index_put_
    for i, p in enumerate(params):
        if rows.num_output[i] < p.min_tokens:
            held = set(p.stop_token_ids) | (set() if p.ignore_eos else set(rows.eos_token_ids))
            cells.extend((i, t, float("-inf")) for t in held if t < vocab)
    held_cells = len(cells)
    for i, p in enumerate(params):
        cells.extend((i, t, b) for t, b in p.logit_bias if t < vocab)
    out = logits
    if cells:
        out = logits.clone()
        index = to_device(torch.tensor([c[:2] for c in cells], dtype=torch.int64), device)  # [N, 2]
        values = to_device(torch.tensor([c[2] for c in cells], dtype=logits.dtype), device)
        if held_cells:
            out.index_put_((index[:held_cells, 0], index[:held_cells, 1]), values[:held_cells])
        if len(cells) > held_cells:  # NOTE: after the -inf: a bias never lifts a held token
            out.index_put_((index[held_cells:, 0], index[held_cells:, 1]), values[held_cells:],
                           accumulate=True)  # fmt: skip
    if not any(p.penalized for p in params):
        return out
    counts = rows.output_counts  # [B, V]
    if any(p.repetition_penalty != 1 for p in params):
        seen = (counts > 0) | rows.prompt_seen
        penalty = _column([p.repetition_penalty for p in params], device)
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        frequency = _column([p.frequency_penalty for p in params], device)
        presence = _column([p.presence_penalty for p in params], device)
        out = out - frequency * counts - presence * (counts > 0)
    return out


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row: [B, V] float32 (ids >= vocab are left out)."""
    width = max((len(r) for r in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.int64)  # [B, L+1], pad: vocab
    for i, r in enumerate(ids):
        if len(r):
            padded[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
    padded = padded.clamp_(max=vocab).to(device, non_blocking=True)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for the device: on CUDA through pinned
    memory, since a copy from pageable memory first waits for the stream's earlier work (after
    a chained decode step's launch, that is the whole step: runner.py)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
