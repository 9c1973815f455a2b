"""The KV cache's blocks: reference counts, and the prefix cache's index of full blocks by content.

A full block (block_size computed tokens) is named by a hash chained over the sequence's tokens,
    hash_i = sha256(hash_{i-1} || token ids of block i)        (hash_{-1} = b"")
so equal hashes mean equal prefixes up to and including that block, hence equal K/V (K/V at a
position depends only on the tokens up to it). Each block is in exactly one state:

    free      ref 0, no hash      in `_free`; taken first
    cached    ref 0, a hash       in `_cached` (least recently released first); reused last, and
                                  then it loses its hash (an eviction, reported to the caller)
    in use    ref > 0             held by that many sequences (shared prefix blocks: ref > 1)

`take` hands out blocks with ref 1; `touch` takes one more reference on a block found by `lookup`;
`release` drops one (a cached block found again goes back to "in use" without a copy).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Append to `hashes` the chained hashes of token_ids's full blocks it does not hold yet."""
    for i in range(len(hashes), len(token_ids) // block_size):
        block = np.asarray(token_ids[i * block_size : (i + 1) * block_size], dtype=np.int64)
        parent = hashes[-1] if hashes else b""
        hashes.append(hashlib.sha256(parent + block.tobytes()).digest())


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref-0 blocks with a hash, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks `take` can hand out: free ones and cached ones (which it evicts)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a prefix and could be found by `lookup` (in use or not)."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def is_evictable(self, block: int) -> bool:
        return block in self._cached

    def touch(self, block: int) -> None:
        """One more reference on `block` (found by lookup); a cached block is in use again."""
        if self._ref[block] == 0:
            del self._cached[block]
        self._ref[block] += 1

    def take(self, n: int) -> tuple[list[int], list[tuple[int, bytes]]]:
        """n blocks with ref 1, free ones first, then the least recently released cached ones;
        and the (block, hash) pairs those evicted. The caller checked n <= num_free."""
        if n > self.num_free:
            raise ValueError(f"{n} blocks asked for, {self.num_free} free")
        blocks, evicted = [], []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                block_hash = self._hash_of.pop(block)
                del self._block_of[block_hash]
                evicted.append((block, block_hash))
            self._ref[block] = 1
            blocks.append(block)
        return blocks, evicted

    def release(self, blocks: Iterable[int]) -> None:
        """One reference less on each; blocks no one holds become cached (with a hash) or free.
        NOTE: callers release a sequence's blocks last first, so its tail is evicted first (a
        block is only found after the blocks before it)."""
        for block in blocks:
            if self._ref[block] <= 0:
                raise ValueError(f"block {block} released more often than taken")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Index an in-use block, now full of computed tokens, under its hash; False (and nothing
        indexed) when caching is off, or another block already holds that prefix."""
        if not self.enable_caching or block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def reset(self) -> None:
        """Forget every hash: cached blocks become free, blocks in use stay with their holders."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()
