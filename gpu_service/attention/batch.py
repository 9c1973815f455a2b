"""What one forward step computes, and the index tensors attention needs for it.

A step runs a batch of B sequences, each contributing n_i >= 1 new tokens at positions
[start_pos_i, start_pos_i + n_i): a prefill (n_i = prompt length, start 0), a decode (n_i = 1), or a
chunk of either. Layout (ragged, flattened, nothing padded):
    tokens        [T]           T = sum n_i, sequence after sequence
    hidden        [T, H]        every projection, norm and MoE runs on this flat batch
Attention (paged_attention.py) takes the sequences in groups, each with its own rows of T and
index tensors (AttentionGroup):
    cu_seqlens_q  [b + 1] int32 member i's rows (of the group's) are cu_seqlens_q[i]:[i + 1]
    kv_len        [b] int32     L_i = start_pos_i + n_i: its keys are positions 0..L_i - 1
    block_table   [b, W] int32  its cache blocks (W: the most any member needs; unused entries
                                0, never read); slot = block * block_size + offset
the decodes (n_i = 1: one query at L_i - 1, batched) and the prefills (n_i > 1: ragged, causal
over their own keys). On the CPU the decodes go in one group per width class (block counts within
the same power of two), so short rows beside a long one never gather its keys; on CUDA they stay
one group (the shape a decode graph captures).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_service.kvcache.sequence import SeqCache
from gpu_service.kvcache.tensors import KVCacheTensors


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a step: `token_ids` at positions start_pos, start_pos + 1, ...

    `cache` must already hold positions [0, start_pos) and have capacity for the new tokens
    (KVCacheManager.extend); the step writes the new tokens' K/V and sets cache.num_tokens.
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


Rows = slice | torch.Tensor  # a group's rows of T: a slice where they are contiguous


def num_rows(rows: Rows) -> int:
    """How many rows a group has (no device sync)."""
    return rows.stop - rows.start if isinstance(rows, slice) else rows.shape[0]


@dataclass(frozen=True)
class AttentionGroup:
    """Decode sequences of a step (all, or on the CPU one width class), or its prefills."""

    rows: Rows
    block_table: torch.Tensor  # [b, W] int32
    cu_seqlens_q: torch.Tensor  # [b + 1] int32, into the group's own rows
    kv_len: torch.Tensor  # [b] int32
    # NOTE: what a decode kernel plans from kv_len (FlashMLA's split schedule), made by the
    # step's first attention layer and read by the others: a group lives for one step (or one
    # capture, whose replays remake the plan in its first layer), so it never outlives kv_len
    plans: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    last_index: torch.Tensor  # [B] int64 into the flat T
    block_size: int
    decodes: tuple[AttentionGroup, ...]  # sequences with one new token (none: empty)
    prefill: AttentionGroup | None  # sequences with more

    @classmethod
    def build(cls, batch: Batch, device: torch.device | str) -> AttentionMetadata:
        device = torch.device(device)
        positions, slot_mapping = [], []
        block_size = batch.seqs[0].cache.block_size
        for s in batch.seqs:
            positions.extend(range(s.start_pos, s.end_pos))
            slot_mapping.extend(s.cache.slots(s.start_pos, s.end_pos))
        blocks = [s.cache.block_ids[: -(-s.end_pos // block_size)] for s in batch.seqs]
        cu_seqlens = batch.cu_seqlens
        kv_len = [s.end_pos for s in batch.seqs]

        def tensor(data: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(device)

        def group(members: list[int]) -> AttentionGroup:
            rows = [r for i in members for r in range(cu_seqlens[i], cu_seqlens[i + 1])]
            lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in members]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            return AttentionGroup(
                rows=slice(rows[0], rows[0] + len(rows))
                if contiguous
                else tensor(rows, torch.int64),
                block_table=tensor(_padded([blocks[i] for i in members])),
                cu_seqlens_q=tensor(list(itertools.accumulate(lens, initial=0))),
                kv_len=tensor([kv_len[i] for i in members]),
            )

        decodes = [i for i, s in enumerate(batch.seqs) if len(s.token_ids) == 1]
        prefills = [i for i, s in enumerate(batch.seqs) if len(s.token_ids) > 1]
        if device.type == "cpu":
            decode_groups = _width_classes(decodes, [len(b) for b in blocks])
        else:  # NOTE: one group, as a CUDA decode graph captures it (decode_graphs.py)
            decode_groups = [decodes] if decodes else []
        return cls(
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slot_mapping, torch.int64),
            last_index=tensor(cu_seqlens[1:], torch.int64) - 1,
            block_size=block_size,
            decodes=tuple(group(members) for members in decode_groups),
            prefill=group(prefills) if prefills else None,
        )


def _padded(tables: list[list[int]]) -> list[list[int]]:
    """Block lists as rows of one table, as wide as the longest (the rest 0, never read)."""
    width = max(len(blocks) for blocks in tables)
    return [blocks + [0] * (width - len(blocks)) for blocks in tables]


def _width_classes(members: list[int], widths: list[int]) -> list[list[int]]:
    """members grouped by the power-of-two class of their widths, in order of first appearance."""
    classes: dict[int, list[int]] = {}
    for i in members:
        classes.setdefault(widths[i].bit_length(), []).append(i)
    return list(classes.values())


@dataclass(frozen=True)
class StepContext:
    """Everything the layers share during one step."""

    meta: AttentionMetadata
    cos: torch.Tensor  # [T, rope_dim/2] float32
    sin: torch.Tensor  # [T, rope_dim/2] float32
    kv_cache: KVCacheTensors
