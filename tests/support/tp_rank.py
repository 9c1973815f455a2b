"""One rank of a tensor-parallel model in a spawned process (imports no transformers: a
spawned child imports the module of its target)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.layers.sharding import TensorParallel
from gpu_service.models import Batch, SeqInput, TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader

TIMEOUT = datetime.timedelta(seconds=120)


def run_rank(rank: int, world: int, port: int, path: str, prompts, out) -> None:
    """Join the group at the TCPStore on `port`, load this rank's share of `path` (rank 0 with
    every expert in torch), prefill `prompts` together; rank 0 puts the last-position logits
    [B, V] on `out`."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        torch.set_num_threads(1)
        tp = TensorParallel(rank, world, dist.group.WORLD)
        experts = TorchExperts(CheckpointReader(path)) if rank == 0 else None
        model = load_model(path, "cpu", torch.float32, experts=experts,
                           max_num_tokens_in_cache=64, tp=tp)  # fmt: skip
        kv = KVCacheManager(model.kv_cache.config)
        caches = [kv.allocate(len(p)) for p in prompts]
        logits = model.run(Batch(tuple(SeqInput(p, c, 0) for p, c in zip(prompts, caches))))
        if rank == 0:
            out.put(logits)
    finally:
        dist.destroy_process_group()
