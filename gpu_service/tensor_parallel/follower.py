"""A tensor-parallel follower, rank 1..N-1: `python -m gpu_service.tensor_parallel.follower`,
started by rank 0 (leader.py), which writes its messages (messages.py) to this process's stdin.

    Setup -> join the TCPStore, store "alive/<rank>", join the process group, load this rank's
             share of the model (no expert backend: only rank 0 calls the experts), store
             "loaded/<rank>"
    Cache -> a KV cache of that size for the next steps (the blocks are rank 0's to assign)
    Step  -> the same forward as rank 0, on the same cache blocks, up to the last layer
    Stop or end of file -> leave the group, exit 0

Any error is printed and ends the process with status 1: rank 0 notices the exit (or the
collective it is in fails) and fails loudly.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from gpu_service.layers.sharding import TensorParallel
from gpu_service.models import Batch, KVCacheTensors, SeqInput, load_model
from gpu_service.models.model import CausalLM
from gpu_service.tensor_parallel.messages import Cache, Setup, Step, Stop, read_message
from ktserve.parent_process import follow_parent

log = logging.getLogger("ktserve.tp")


def join(setup: Setup) -> tuple[TensorParallel, dist.TCPStore]:
    timeout = datetime.timedelta(seconds=setup.timeout_s)
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.world_size, is_master=False,
                          timeout=timeout)  # fmt: skip
    store.set(f"alive/{setup.rank}", "1")
    dist.init_process_group(setup.backend, store=store, rank=setup.rank,
                            world_size=setup.world_size, timeout=timeout)  # fmt: skip
    return TensorParallel(setup.rank, setup.world_size, dist.group.WORLD), store


def load(setup: Setup, tp: TensorParallel) -> CausalLM:
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":  # NOTE: the ranks share the host's cores (rank 0 keeps its own)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.world_size))
    return load_model(setup.model_dir, device, setup.dtype, experts=None,
                      max_num_tokens_in_cache=16, linear_quant=setup.linear_quant,
                      tp=tp, attention=setup.attention)  # fmt: skip


def run_step(model: CausalLM, step: Step) -> None:
    block = model.kv_cache.config.block_size
    batch = Batch(tuple(SeqInput(s.token_ids, s.cache(block), s.start_pos) for s in step.seqs))
    model.run(batch, step.all_positions, logits=False)


def serve(stdin) -> None:
    setup = read_message(stdin)
    if not isinstance(setup, Setup):
        raise RuntimeError(f"expected a Setup message first, got {type(setup).__name__}")
    tp, store = join(setup)
    try:
        model = load(setup, tp)
        store.set(f"loaded/{setup.rank}", "1")
        log.info("tensor-parallel rank %d of %d: loaded on %s", tp.rank, tp.world_size,
                 setup.device)  # fmt: skip
        while True:
            message = read_message(stdin)
            if message is None or isinstance(message, Stop):
                return
            if isinstance(message, Cache):
                config = replace(model.kv_cache.config, max_num_tokens=message.max_num_tokens,
                                 block_size=message.block_size, enable_prefix_caching=False,
                                 max_num_host_tokens=0)  # fmt: skip
                model.kv_cache = None  # NOTE: free the old one before the new one is allocated
                model.kv_cache = KVCacheTensors(config, message.dtype, model.device)
            elif isinstance(message, Step):
                run_step(model, message)
            else:
                raise RuntimeError(f"unexpected message {type(message).__name__}")
    finally:
        dist.destroy_process_group()


def main() -> int:
    follow_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-follower %(message)s")
    try:
        serve(sys.stdin.buffer)
    except Exception:  # noqa: BLE001 - printed; the exit status tells rank 0
        log.exception("tensor-parallel follower failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
