"""The served path with the GPU part's linears quantized (--gpu-weight-format fp8|int8|int4): GPU
service (this process) + `ktserve expert` (a subprocess, bf16 experts) over ktshm. The engine's
greedy tokens (on CUDA its decode steps replay CUDA graphs) are each the argmax of the same
model's eager forward over prompt + tokens, and the memory plan is made, logged and exported."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_service.layers.linear import FP8Linear, Int4Linear, Int8Linear
from gpu_service.memory_plan import PARTS
from gpu_service.models import Batch, SeqInput
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse
from tests.support.parity import greedy_together
from tests.support.worker_services import DEVICE, worker_service

MODULES = {"fp8": FP8Linear, "int8": Int8Linear, "int4": Int4Linear}
NUM_TOKENS = 8
# How far below the eager argmax an engine token's logit may be: float32 on the CPU (the engine
# and the eager forward run the same kernels); bfloat16 on CUDA, where graphs and batch sizes
# pick other GEMM tiles.
ARGMAX_SLACK = {"cpu": 1e-4, "cuda": 0.05}


CHECKPOINT = TinyCheckpoint("deepseek_v3")


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_served_quantized_gpu_part(checkpoint, seed, fmt):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 12, 3)]
    print(f"seed={seed} format={fmt} device={DEVICE}")
    worker = ExpertProcess("--model", str(checkpoint), "--format", "bf16")
    service = None
    try:
        service = worker_service(checkpoint, worker, max_model_len=64, gpu_weight_format=fmt,
                                 gpu_memory_utilization=0.02)  # fmt: skip
        model, plan = service.engine.model, service.memory_plan
        print(plan.table())
        assert type(model.layers[0].attn.q_b_proj) is MODULES[fmt]
        assert model.kv_cache.config.max_num_tokens == plan.kv_cache_tokens
        if DEVICE == "cuda":
            assert set(plan.parts) == set(PARTS) and sum(plan.parts.values()) == plan.budget
        else:
            assert set(plan.parts) == {"weights", "kv_cache"}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(
                       generate_latest(service.metrics.registry).decode())
                   for s in family.samples}  # fmt: skip
        assert samples[("ktserve_kv_cache_capacity_tokens", ())] == plan.kv_cache_tokens
        weights = samples[("ktserve_gpu_memory_plan_bytes", (("part", "weights"),))]
        assert weights == plan.parts["weights"]

        outputs = greedy_together(service, prompts, NUM_TOKENS)
        service.engine.stop()  # the eager forwards below run on this thread
        for prompt, tokens in zip(prompts, outputs):
            seq = prompt + tokens
            kv = service.engine.scheduler.kv_manager
            cache = kv.allocate(len(seq))
            try:
                logits = model.forward(Batch((SeqInput(seq, cache, 0),)), all_positions=True)
            finally:
                kv.free(cache)
            rows = logits[len(prompt) - 1 : len(seq) - 1]  # [n, V]
            chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
            gap = float((rows.max(dim=1).values - chosen).max())
            scale = float(rows.abs().max())
            print(f"prompt of {len(prompt)}: {tokens}, largest gap below argmax {gap:.2e} "
                  f"(logits up to {scale:.2f})")  # fmt: skip
            assert gap <= ARGMAX_SLACK[DEVICE] * max(scale, 1.0)
    finally:
        if service is not None:
            service.close()
        worker.close()


def test_close_gives_the_kv_cache_back_though_the_service_is_held(checkpoint, seed):
    """A closed service's KV cache (and decode graphs) go at close(), not when the last
    reference to the service does: a benchmark's next service in the same process plans its
    memory from what is free."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 101, (6,), generator=gen).tolist()
    worker = ExpertProcess("--model", str(checkpoint), "--format", "bf16")
    service = None
    try:
        service = worker_service(checkpoint, worker, max_model_len=64)
        greedy_together(service, [prompt], 4)
        tensors = [weakref.ref(t) for layer in service.engine.model.kv_cache.layers
                   for t in layer]  # fmt: skip
        assert tensors and all(ref() is not None for ref in tensors)
        service.close()
        gc.collect()
        assert all(ref() is None for ref in tensors), "close() left the KV cache allocated"
    finally:
        if service is not None:
            service.close()
        worker.close()
