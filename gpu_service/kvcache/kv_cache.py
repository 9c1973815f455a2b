"""Paged KV cache: one allocation up front, handed out to sequences in fixed-size blocks, with
automatic prefix caching over them (and, optionally, a second tier in host RAM).

Memory layout, per layer and per component (GQA: key and value; MLA: one compressed latent):
    tensor [num_blocks * block_size, *entry_shape]      slot s = block_id * block_size + offset
A sequence owns a list of blocks (`SeqCache.block_ids`); its token at position p lives in slot
    block_ids[p // block_size] * block_size + p % block_size.
Entry shapes: GQA (num_kv_heads, head_dim) for k and for v; MLA (kv_lora_rank + qk_rope_head_dim,),
the normalized compressed kv followed by the roped shared key, per token.
Storage dtype: the model's, or FP8 (float8_e4m3fn, --kv-cache-dtype fp8): written with a saturating
cast (write_cache; per-tensor scale 1.0, values beyond +-448 clamp), upcast as attention reads it.
One more slot past the blocks, `scratch_slot`, belongs to no sequence: padding rows of a fixed-size
decode batch (CUDA graphs) write their K/V there.

Lifecycle (paired verbs): can_allocate/allocate a sequence for its prompt, can_extend/extend it as
decoding grows it, free it when finished. Running out raises `KVCacheFull` (never blocks).

Prefix caching (block_pool.py): given the chained hashes of its full blocks, `allocate` starts a
sequence with the longest prefix found (blocks shared, reference counted; at most
num_tokens - 1 tokens, so the last one is always computed), and its `num_tokens` says where the
prefill starts. `cache_blocks` indexes a sequence's blocks once they are full of computed tokens;
freed, they stay findable until a later allocation reuses them, least recently freed first.
NOTE: a step writes K/V only at positions >= num_tokens, never into a full (shared) block.
With a host tier (host_tier.py) an evicted block is copied to host RAM, and a prefix found there
is copied back into fresh blocks. Those copies are decided here and queued; `take_copies` hands
them to the step, and the runner runs them (`copy_blocks`, in the order queued) before its forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu_service.kvcache.block_pool import BlockPool
from gpu_service.kvcache.host_tier import BlockCopy, HostTier

FP8 = torch.float8_e4m3fn


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values, cast to the cache's dtype (saturating where it is FP8)."""
    if cache.dtype != FP8:
        cache[slots] = values.to(cache.dtype)
        return
    limit = torch.finfo(FP8).max
    # NOTE: FP8 moves as bytes: indexing kernels do not cover FP8 on every device and version
    cache.view(torch.uint8)[slots] = values.clamp(-limit, limit).to(FP8).view(torch.uint8)


def read_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots], in the cache's dtype."""
    if cache.dtype != FP8:
        return cache[slots]
    return cache.view(torch.uint8)[slots].view(FP8)


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
    """One sequence's share of the cache. `num_tokens`: positions [0, num_tokens) hold K/V.
    `num_hashed_blocks`: its first blocks already offered to the prefix cache."""

    seq_id: int
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    freed: bool = False
    num_hashed_blocks: int = 0

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
    enable_prefix_caching: bool = True
    max_num_host_tokens: int = 0  # the host tier's size; 0: none

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or not self.entry_shapes:
            raise ValueError("a KV cache needs at least one layer and one component")
        if self.max_num_tokens <= 0 or self.block_size <= 0:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} and block_size={self.block_size} "
                "must be positive"
            )
        if self.max_num_host_tokens < 0:
            raise ValueError(f"max_num_host_tokens must be >= 0, got {self.max_num_host_tokens}")

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.max_num_tokens / self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (none without prefix caching)."""
        return self.max_num_host_tokens // self.block_size if self.enable_prefix_caching else 0

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes over all layers: what the engine sizes the cache by."""
        elems = sum(math.prod(shape) for shape in self.entry_shapes)
        return self.num_layers * elems * torch.empty((), dtype=dtype).element_size()


@dataclass
class PrefixCacheStats:
    """Tokens, since the cache was made: looked up at allocation, and found per tier."""

    queries: int = 0
    device_hits: int = 0
    host_hits: int = 0


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
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.host: HostTier | None = None
        if config.num_host_blocks:
            pin = torch.device(device).type == "cuda"
            self.host = HostTier(config.num_host_blocks, self.block_size, self.layers, pin)
        self.stats = PrefixCacheStats()
        self._copies: list[BlockCopy] = []
        self._reading: set[int] = set()  # host blocks being brought back by this allocation
        self._live: dict[int, SeqCache] = {}
        self._next_seq_id = 0

    def release(self) -> None:
        """Drop the cache's tensors (a closed service's device memory goes back at once, whoever
        still holds the service); nothing may use the cache afterwards."""
        self.layers = []
        self.host = None

    @property
    def prefix_caching(self) -> bool:
        return self.config.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some of them cached prefixes, reused last)."""
        return self.pool.num_free

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_blocks * self.block_size

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # ------------------------------------------------------------------ sequences
    def can_allocate(self, num_tokens: int, block_hashes: Sequence[bytes] | None = None) -> bool:
        """Whether a sequence of num_tokens fits, reusing the cached prefix of block_hashes."""
        if num_tokens <= 0:
            return False
        return self._blocks_short(num_tokens, self._match(num_tokens, block_hashes or ())) <= 0

    def allocate(self, num_tokens: int, block_hashes: Sequence[bytes] | None = None) -> SeqCache:
        """A new sequence with room for `num_tokens` tokens. block_hashes (extend_block_hashes of
        its tokens; None: no lookup, and none counted): its first blocks are the longest prefix
        of them cached, and num_tokens of the result counts the tokens they hold."""
        if num_tokens <= 0:
            raise ValueError(f"a sequence needs at least one token, got {num_tokens}")
        hits = self._match(num_tokens, block_hashes or (), touch=True)
        if self._blocks_short(num_tokens, hits) > 0:
            needed = self._blocks_for(num_tokens) - sum(on_device for on_device, _ in hits)
            raise KVCacheFull(num_tokens, needed, self.num_free_blocks, self.block_size)
        for on_device, block in hits:
            if on_device:
                self.pool.touch(block)
        self._reading = {block for on_device, block in hits if not on_device}
        num_new = self._blocks_for(num_tokens) - (len(hits) - len(self._reading))
        try:
            fresh = iter(self._take(num_new))
        finally:
            self._reading = set()
        seq = SeqCache(seq_id=self._next_seq_id, block_size=self.block_size)
        for (on_device, block), block_hash in zip(hits, block_hashes or ()):
            if not on_device:  # NOTE: queued after the evictions _take queued
                host_block, block = block, next(fresh)
                self.pool.register(block, block_hash)
                self._copies.append(BlockCopy(block, host_block, to_host=False))
            seq.block_ids.append(block)
        seq.block_ids.extend(fresh)
        seq.num_hashed_blocks, seq.num_tokens = len(hits), len(hits) * self.block_size
        if self.prefix_caching and block_hashes is not None:
            self.stats.queries += num_tokens
            host_hits = sum(not on_device for on_device, _ in hits)
            self.stats.device_hits += (len(hits) - host_hits) * self.block_size
            self.stats.host_hits += host_hits * self.block_size
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
        needed = self._blocks_for(num_tokens) - len(seq.block_ids)
        if needed <= 0:
            return
        if needed > self.num_free_blocks:
            raise KVCacheFull(num_tokens, needed, self.num_free_blocks, self.block_size)
        seq.block_ids.extend(self._take(needed))

    def free(self, seq: SeqCache) -> None:
        self._check_live(seq)
        del self._live[seq.seq_id]
        self.pool.release(reversed(seq.block_ids))
        seq.block_ids, seq.num_tokens, seq.freed = [], 0, True

    def check_live(self, seq: SeqCache) -> None:
        self._check_live(seq)

    def _check_live(self, seq: SeqCache) -> None:
        if seq.freed or self._live.get(seq.seq_id) is not seq:
            state = "was freed" if seq.freed else "was not allocated by this cache"
            raise InvalidSequenceCache(f"sequence cache {seq.seq_id} {state}")

    # ------------------------------------------------------------------ prefix cache
    def cache_blocks(self, seq: SeqCache, block_hashes: Sequence[bytes]) -> None:
        """Offer seq's blocks that are full of computed tokens to the prefix cache, under
        block_hashes (those of its tokens, at least as many as it has full blocks)."""
        self._check_live(seq)
        full = min(seq.num_tokens // self.block_size, len(block_hashes))
        for i in range(seq.num_hashed_blocks, full):
            self.pool.register(seq.block_ids[i], block_hashes[i])
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def take_copies(self) -> tuple[BlockCopy, ...]:
        """The copies between tiers decided since the last call, in order: run them (copy_blocks)
        before anything writes to the cache."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run copies between the tiers (take_copies), in order."""
        if copies:
            assert self.host is not None, "copies between tiers need a host tier"
            self.host.copy(self.layers, copies)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in both tiers (sequences keep their blocks)."""
        self.pool.reset()
        if self.host is not None:
            self.host.reset()

    def _match(self, num_tokens: int, block_hashes: Sequence[bytes],
               touch: bool = False) -> list[tuple[bool, int]]:  # fmt: skip
        """The longest cached prefix: (on the device, block) per block, at most num_tokens - 1
        tokens (the last token is always computed: its logits are what the step needs). touch:
        the host blocks found become the host tier's most recently used."""
        if not self.prefix_caching:
            return []
        hits = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is not None:
                hits.append((True, block))
                continue
            host_block = self.host.lookup(block_hash, touch) if self.host is not None else None
            if host_block is None:
                break
            hits.append((False, host_block))
        return hits

    def _blocks_short(self, num_tokens: int, hits: list[tuple[bool, int]]) -> int:
        """How many blocks a sequence of num_tokens starting with `hits` lacks (<= 0: fits).
        A hit on a cached block no one holds takes that block out of the free ones."""
        on_device = [block for found, block in hits if found]
        unheld = sum(self.pool.is_evictable(block) for block in on_device)
        return self._blocks_for(num_tokens) - len(on_device) - (self.num_free_blocks - unheld)

    def _take(self, n: int) -> list[int]:
        blocks, evicted = self.pool.take(n)
        if self.host is not None:
            for block, block_hash in evicted:
                host_block = self.host.store(block_hash, self._reading)
                if host_block is not None:
                    self._copies.append(BlockCopy(block, host_block, to_host=True))
        return blocks
