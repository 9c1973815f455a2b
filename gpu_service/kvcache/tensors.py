"""The KV cache's memory: one allocation up front, per layer and per component, which the
model's attention reads and writes, and (optionally) its second tier in host RAM. Which blocks a
sequence holds is the manager's business (manager.py); steps carry the block tables as data.

Memory layout, per layer and per component (GQA: key and value; MLA: one compressed latent):
    tensor [num_blocks * block_size, *entry_shape]      slot s = block_id * block_size + offset
A sequence's token at position p lives in slot
    block_ids[p // block_size] * block_size + p % block_size       (SeqCache.slots)
Entry shapes: GQA (num_kv_heads, head_dim) for k and for v; MLA (kv_lora_rank + qk_rope_head_dim,),
the normalized compressed kv followed by the roped shared key, per token.
Storage dtype: the model's, or FP8 (float8_e4m3fn, --kv-cache-dtype fp8): written with a saturating
cast (write_cache; per-tensor scale 1.0, values beyond +-448 clamp), upcast as attention reads it.
One more slot past the blocks, `scratch_slot`, belongs to no sequence: padding rows of a fixed-size
decode batch (CUDA graphs) write their K/V there.
The host tier has the same layout, in host memory (pinned when the device is CUDA), over its own
blocks; `copy_blocks` runs the copies between the tiers that the manager queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_service.kvcache.config import KVCacheConfig
from gpu_service.kvcache.host_tier import BlockCopy

FP8 = torch.float8_e4m3fn

Layers = list[tuple[torch.Tensor, ...]]


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


class KVCacheTensors:
    def __init__(self, config: KVCacheConfig, dtype: torch.dtype, device: torch.device | str):
        self.config = config
        self.block_size = config.block_size
        self.scratch_slot = config.num_slots
        self.layers: Layers = [
            tuple(
                torch.zeros((config.num_slots + 1, *shape), dtype=dtype, device=device)
                for shape in config.entry_shapes
            )
            for _ in range(config.num_layers)
        ]
        self.host_layers: Layers = []
        if config.num_host_blocks:
            pin = torch.device(device).type == "cuda"
            host_slots = config.num_host_blocks * config.block_size
            self.host_layers = [
                tuple(torch.zeros((host_slots, *shape), dtype=dtype, pin_memory=pin)
                      for shape in config.entry_shapes)
                for _ in range(config.num_layers)
            ]  # fmt: skip

    def release(self) -> None:
        """Drop the cache's tensors (a closed service's device memory goes back at once, whoever
        still holds the service); nothing may use the cache afterwards."""
        self.layers = []
        self.host_layers = []

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run copies between the tiers (KVCacheManager.take_copies), in order: runs of one
        direction with distinct targets go as one gather and one scatter per tensor."""
        if not copies:
            return
        assert self.host_layers, "copies between tiers need a host tier"
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
            self._copy_run(copies[start:end], to_host)
            start = end

    def _copy_run(self, copies: Sequence[BlockCopy], to_host: bool) -> None:
        device_slots = self._slots([c.device_block for c in copies])
        host_slots = self._slots([c.host_block for c in copies])
        for device_layer, host_layer in zip(self.layers, self.host_layers):
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
