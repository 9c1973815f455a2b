"""What one forward step computes, and the index tensors attention needs for it.

A step runs a batch of B sequences, each contributing n_i >= 1 new tokens at positions
[start_pos_i, start_pos_i + n_i): a prefill (n_i = prompt length, start 0), a decode (n_i = 1), or a
chunk of either. Layout (ragged, flattened):
    tokens      [T]          T = sum n_i, sequence after sequence (cu_seqlens = [0, n_0, ..])
    hidden      [T, H]       every projection, norm and MoE runs on this flat batch
Attention pads per sequence: queries are gathered into [B, Qmax] (q_index), each sequence's cached
keys into [B, Kmax] (kv_slots, positions 0..L_i-1 with L_i = start_pos_i + n_i), and a boolean mask
[B, Qmax, Kmax] allows kv_pos <= q_pos (and kv_pos > q_pos - window with a sliding window).
Padding rows/columns point at slot 0 and are masked out; padded queries are dropped afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_service.models.kv_cache import KVCache, SeqCache


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a step: `token_ids` at positions start_pos, start_pos + 1, ...

    `cache` must already hold positions [0, start_pos) and have capacity for the new tokens
    (KVCache.extend); the step writes the new tokens' K/V and sets cache.num_tokens.
    """

    token_ids: Sequence[int]
    cache: SeqCache
    start_pos: int

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError(f"sequence {self.cache.seq_id}: a step needs at least one token")
        if not 0 <= self.start_pos <= self.cache.num_tokens:
            raise ValueError(
                f"sequence {self.cache.seq_id}: start_pos {self.start_pos} is outside "
                f"[0, {self.cache.num_tokens}] (the tokens already in its cache)"
            )

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class Batch:
    seqs: tuple[SeqInput, ...]

    def __post_init__(self) -> None:
        if not self.seqs:
            raise ValueError("a batch needs at least one sequence")
        ids = [s.cache.seq_id for s in self.seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a sequence appears twice in one batch: {ids}")

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for s in self.seqs:
            out.append(out[-1] + len(s.token_ids))
        return out


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    q_index: torch.Tensor  # [B, Qmax] int64 into the flat T
    q_valid: torch.Tensor  # [B, Qmax] bool
    q_pos: torch.Tensor  # [B, Qmax] int64 (padding: the sequence's last position)
    kv_slots: torch.Tensor  # [B, Kmax] int64
    kv_len: torch.Tensor  # [B] int64
    last_index: torch.Tensor  # [B] int64 into the flat T

    @classmethod
    def build(cls, batch: Batch, device: torch.device | str) -> AttentionMetadata:
        positions, slot_mapping, q_index, q_pos, kv_slots = [], [], [], [], []
        qmax = max(len(s.token_ids) for s in batch.seqs)
        kmax = max(s.end_pos for s in batch.seqs)
        offset = 0
        for s in batch.seqs:
            n, end = len(s.token_ids), s.end_pos
            positions.extend(range(s.start_pos, end))
            slot_mapping.extend(s.cache.slots(s.start_pos, end))
            q_index.append([offset + min(j, n - 1) for j in range(qmax)])
            q_pos.append([s.start_pos + min(j, n - 1) for j in range(qmax)])
            kv_slots.append(s.cache.slots(0, end) + [0] * (kmax - end))
            offset += n
        lens = [len(s.token_ids) for s in batch.seqs]

        def tensor(data: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(device)

        return cls(
            positions=tensor(positions),
            slot_mapping=tensor(slot_mapping),
            q_index=tensor(q_index),
            q_valid=tensor([[j < n for j in range(qmax)] for n in lens], torch.bool),
            q_pos=tensor(q_pos),
            kv_slots=tensor(kv_slots),
            kv_len=tensor([s.end_pos for s in batch.seqs]),
            last_index=tensor(batch.cu_seqlens[1:]) - 1,
        )

    def mask(self, window: int | None = None) -> torch.Tensor:
        """[B, Qmax, Kmax] bool: True where query may attend to key."""
        kv_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)  # [Kmax]
        q_pos = self.q_pos[:, :, None]  # [B, Qmax, 1]
        allowed = (kv_pos[None, None, :] <= q_pos) & (
            kv_pos[None, None, :] < self.kv_len[:, None, None]
        )
        if window is not None:
            allowed &= kv_pos[None, None, :] > q_pos - window
        return allowed


@dataclass(frozen=True)
class StepContext:
    """Everything the layers share during one step."""

    meta: AttentionMetadata
    cos: torch.Tensor  # [T, rope_dim/2] float32
    sin: torch.Tensor  # [T, rope_dim/2] float32
    kv_cache: KVCache
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self._masks:
            self._masks[window] = self.meta.mask(window)
        return self._masks[window]
