"""The KV cache's books, owned by the scheduler: which blocks each sequence holds, the prefix
cache over them and its host tier. It touches no tensor: the blocks it hands out are rows of
the cache's tensors (tensors.py), which the model and the runner hold.

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
them to the step, and the runner runs them (KVCacheTensors.copy_blocks, in the order queued)
before its forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_service.kvcache.block_pool import BlockPool
from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.host_tier import BlockCopy, HostTier
from gpu_service.kvcache.sequence import InvalidSequenceCache, SeqCache


class KVCacheFull(RuntimeError):
    """The cache has too few free blocks for the request; nothing was allocated."""

    def __init__(self, num_tokens: int, blocks_needed: int, blocks_free: int, block_size: int):
        super().__init__(
            f"KV cache is full: {num_tokens} tokens need {blocks_needed} more blocks of "
            f"{block_size} tokens but only {blocks_free} are free; wait for sequences to finish, "
            "shorten the prompt, or give the cache more memory"
        )


@dataclass
class PrefixCacheStats:
    """Tokens, since the cache was made: looked up at allocation, and found per tier."""

    queries: int = 0
    device_hits: int = 0
    host_hits: int = 0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig):
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.host = HostTier(config.num_host_blocks) if config.num_host_blocks else None
        self.stats = PrefixCacheStats()
        self._copies: list[BlockCopy] = []
        self._reading: set[int] = set()  # host blocks being brought back by this allocation
        self._live: dict[int, SeqCache] = {}
        self._next_seq_id = 0

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

    def _check_live(self, seq: SeqCache) -> None:
        seq.check_not_freed()
        if self._live.get(seq.seq_id) is not seq:
            raise InvalidSequenceCache(
                f"sequence cache {seq.seq_id} was not allocated by this cache"
            )

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
        """The copies between tiers decided since the last call, in order: run them
        (KVCacheTensors.copy_blocks) before anything writes to the cache."""
        copies, self._copies = tuple(self._copies), []
        return copies

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
