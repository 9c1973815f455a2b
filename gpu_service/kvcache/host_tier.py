"""The prefix cache's second tier: full KV blocks evicted from the device cache, kept in host RAM.

Layout, per layer and component, as the device cache's (kv_cache.py), in host memory (pinned when
the device is CUDA): tensor [num_blocks * block_size, *entry_shape]. Blocks are named by the
same chained hashes as block_pool.py's; the least recently stored or found is replaced first.
KVCache decides which blocks move (and queues BlockCopy's); `copy` moves them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockCopy:
    """One block's K/V from the device cache to the host tier (to_host) or back."""

    device_block: int
    host_block: int
    to_host: bool


class HostTier:
    def __init__(self, num_blocks: int, block_size: int, like: list[tuple[torch.Tensor, ...]],
                 pin: bool) -> None:  # fmt: skip
        """like: the device cache's layers (shapes and dtype are copied from them)."""
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        slots = num_blocks * block_size
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer)
            for layer in like
        ]
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

    def copy(self, device_layers: list[tuple[torch.Tensor, ...]], copies: Sequence[BlockCopy]):
        """Run copies between the device cache's layers and this tier's, in order: runs of one
        direction with distinct targets go as one gather and one scatter per tensor."""
        start = 0
        while start < len(copies):
            end, targets, to_host = start, set(), copies[start].to_host
            while end < len(copies) and copies[end].to_host == to_host:
                c = copies[end]
                target = c.host_block if to_host else c.device_block
                if target in targets:
                    break
                targets.add(target)
                end += 1
            self._copy_run(device_layers, copies[start:end], to_host)
            start = end

    def _copy_run(self, device_layers: list[tuple[torch.Tensor, ...]],
                  copies: Sequence[BlockCopy], to_host: bool) -> None:  # fmt: skip
        device_slots = self._slots([c.device_block for c in copies])
        host_slots = self._slots([c.host_block for c in copies])
        for device_layer, host_layer in zip(device_layers, self.layers):
            for dev, host in zip(device_layer, host_layer):
                dev, host = _raw(dev), _raw(host)
                slots = device_slots.to(dev.device)
                if to_host:
                    host.index_copy_(0, host_slots, dev.index_select(0, slots).cpu())
                else:
                    rows = host.index_select(0, host_slots)  # [n * block_size, *entry]
                    dev.index_copy_(0, slots, rows.to(dev.device, non_blocking=True))

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * block_size] int64: the slots of these blocks, block after block."""
        offsets = torch.arange(self.block_size)
        return (torch.tensor(blocks)[:, None] * self.block_size + offsets).flatten()


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes where its dtype is FP8 (index_copy_ has no FP8 kernel on the CPU)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
