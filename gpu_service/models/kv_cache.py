"""Paged KV cache: one allocation up front, handed out to sequences in fixed-size blocks.

Memory layout, per layer and per component (GQA: key and value; MLA: one compressed latent):
    tensor [num_blocks * block_size, *entry_shape]      slot s = block_id * block_size + offset
A sequence owns a list of blocks (`SeqCache.block_ids`); its token at position p lives in slot
    block_ids[p // block_size] * block_size + p % block_size.
Entry shapes: GQA (num_kv_heads, head_dim) for k and for v; MLA (kv_lora_rank + qk_rope_head_dim,),
the normalized compressed kv followed by the roped shared key, per token.
One more slot past the blocks, `scratch_slot`, belongs to no sequence: padding rows of a fixed-size
decode batch (CUDA graphs) write their K/V there.

Lifecycle (paired verbs): can_allocate/allocate a sequence for its prompt, can_extend/extend it as
decoding grows it, free it when finished. Running out raises `KVCacheFull` (never blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class KVCacheFull(RuntimeError):
    """The cache has too few free blocks for the request; nothing was allocated."""

    def __init__(self, num_tokens: int, blocks_needed: int, blocks_free: int, block_size: int):
        super().__init__(
            f"KV cache is full: {num_tokens} tokens need {blocks_needed} more blocks of "
            f"{block_size} tokens but only {blocks_free} are free; wait for sequences to finish, "
            "shorten the prompt, or give the cache more memory"
        )


class InvalidSequenceCache(ValueError):
    """A handle that this cache did not hand out, or that was already freed."""


@dataclass
class SeqCache:
    """One sequence's share of the cache. `num_tokens`: positions [0, num_tokens) hold K/V."""

    seq_id: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end)."""
        bs = self.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]


@dataclass(frozen=True)
class KVCacheConfig:
    num_layers: int
    entry_shapes: tuple[tuple[int, ...], ...]  # per component, e.g. ((kvh, d), (kvh, d))
    max_num_tokens: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or not self.entry_shapes:
            raise ValueError("a KV cache needs at least one layer and one component")
        if self.max_num_tokens <= 0 or self.block_size <= 0:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} and block_size={self.block_size} "
                "must be positive"
            )

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.max_num_tokens / self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes over all layers: what the engine sizes the cache by."""
        elems = sum(math.prod(shape) for shape in self.entry_shapes)
        return self.num_layers * elems * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(self, config: KVCacheConfig, dtype: torch.dtype, device: torch.device | str):
        self.config = config
        self.block_size = config.block_size
        self.scratch_slot = config.num_slots
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(
                torch.zeros((config.num_slots + 1, *shape), dtype=dtype, device=device)
                for shape in config.entry_shapes
            )
            for _ in range(config.num_layers)
        ]
        self._free_blocks: list[int] = list(range(config.num_blocks - 1, -1, -1))
        self._live: dict[int, SeqCache] = {}
        self._next_seq_id = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_blocks * self.block_size

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self._blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, num_tokens: int) -> SeqCache:
        """A new sequence with room for `num_tokens` tokens."""
        if num_tokens <= 0:
            raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
        seq = SeqCache(seq_id=self._next_seq_id, block_size=self.block_size)
        self._take_blocks(seq, num_tokens)
        self._next_seq_id += 1
        self._live[seq.seq_id] = seq
        return seq

    def can_extend(self, seq: SeqCache, num_tokens: int) -> bool:
        """Whether `seq` can grow to hold `num_tokens` tokens in total."""
        self._check_live(seq)
        return self._blocks_for(num_tokens) - len(seq.block_ids) <= self.num_free_blocks

    def extend(self, seq: SeqCache, num_tokens: int) -> None:
        """Grow `seq` to hold `num_tokens` tokens in total (no-op when it already does)."""
        self._check_live(seq)
        self._take_blocks(seq, num_tokens)

    def free(self, seq: SeqCache) -> None:
        self._check_live(seq)
        del self._live[seq.seq_id]
        self._free_blocks.extend(reversed(seq.block_ids))
        seq.block_ids, seq.num_tokens, seq.freed = [], 0, True

    def check_live(self, seq: SeqCache) -> None:
        self._check_live(seq)

    def _check_live(self, seq: SeqCache) -> None:
        if seq.freed or self._live.get(seq.seq_id) is not seq:
            state = "was freed" if seq.freed else "was not allocated by this cache"
            raise InvalidSequenceCache(f"sequence cache {seq.seq_id} {state}")

    def _take_blocks(self, seq: SeqCache, num_tokens: int) -> None:
        needed = self._blocks_for(num_tokens) - len(seq.block_ids)
        if needed <= 0:
            return
        if needed > self.num_free_blocks:
            raise KVCacheFull(num_tokens, needed, self.num_free_blocks, self.block_size)
        for _ in range(needed):
            seq.block_ids.append(self._free_blocks.pop())
