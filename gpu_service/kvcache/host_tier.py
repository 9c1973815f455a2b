"""The prefix cache's second tier: which full KV blocks evicted from the device cache are kept
in host RAM, and where. Blocks are named by the same chained hashes as block_pool.py's; the least
recently stored or found is replaced first. The manager (manager.py) decides which blocks move
and queues BlockCopy's; the tensors (tensors.py) hold the host tier's memory and run them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """One block's K/V from the device cache to the host tier (to_host) or back."""

    device_block: int
    host_block: int
    to_host: bool


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._block_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    @property
    def num_stored(self) -> int:
        return len(self._block_of)

    def lookup(self, block_hash: bytes, touch: bool = True) -> int | None:
        """The host block holding this prefix block (with touch, now the most recently used),
        or None."""
        block = self._block_of.get(block_hash)
        if block is not None and touch:
            self._block_of.move_to_end(block_hash)
        return block

    def store(self, block_hash: bytes, protected: Container[int] = ()) -> int | None:
        """The host block to copy this prefix block into, replacing the least recently used one
        outside `protected` (blocks about to be read); None when it is here already (then it is
        the most recently used) or every block is protected."""
        if self.lookup(block_hash) is not None:
            return None
        if self._free:
            block = self._free.pop()
        else:
            victim = next((h for h, b in self._block_of.items() if b not in protected), None)
            if victim is None:
                return None
            block = self._block_of.pop(victim)
        self._block_of[block_hash] = block
        return block

    def reset(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._block_of.clear()
