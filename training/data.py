"""Token streams and seeded batches for training: documents and chat dialogues, each followed by
<|endoftext|>, concatenated in a seeded order and cut into non-overlapping windows."""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedTokenizerBase


def token_stream(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], eos_token_id: int, seed: int
) -> torch.Tensor:
    """int64 [N]: texts in a seeded order, each followed by eos. Special-token strings inside the
    texts (<|im_start|>, <|im_end|>) become their ids."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    encoded = tokenizer([texts[i] for i in order], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for seq in encoded:
        ids.extend(seq)
        ids.append(eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class WindowBatches:
    """Batches of seq_len-token windows of a stream; each epoch visits every full window once, in
    an order drawn from torch.Generator(seed + epoch)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        num_windows = stream.numel() // seq_len
        if num_windows < batch_size:
            raise ValueError(f"{num_windows} windows of {seq_len} < batch size {batch_size}")
        self.windows = stream[: num_windows * seq_len].view(num_windows, seq_len)  # [W, S]
        self.batch_size = batch_size
        self.seed = seed

    @property
    def batches_per_epoch(self) -> int:
        return self.windows.shape[0] // self.batch_size

    def batch(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len] for a global step (deterministic, no state)."""
        epoch, i = divmod(step, self.batches_per_epoch)
        gen = torch.Generator().manual_seed(self.seed + epoch)
        # NOTE: recomputed per step; cheap next to a training step (a few thousand windows).
        perm = torch.randperm(self.windows.shape[0], generator=gen)
        return self.windows[perm[i * self.batch_size : (i + 1) * self.batch_size]]
