"""Start-up of prefill streaming: auto's share of the free memory before the model loads, its
decision after the memory plan, and the bytes it is judged on against what a built
StreamingExperts holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_service.experts.stream_prefill.backend import StreamingExperts
from gpu_service.experts.stream_prefill.build import (
    AUTO_MAX_FREE_FRACTION,
    build_streaming,
    check_auto_memory,
    kv_room_declines,
    streaming_bytes,
)
from gpu_service.experts.stream_prefill.compute import scratch_bound
from gpu_service.experts.stream_prefill.staging import LayerStager
from tests.support.expert_stores import E, H, I, make_store, open_store

GIB = 2**30


def test_auto_declines_what_would_crowd_a_small_gpu():
    # two layers' packed experts (6,048 MiB each, as the GPU host's copies measured) and the
    # dequantization scratch at DeepSeek-V3's shapes in bf16
    deepseek_int4 = 2 * 6048 * 2**20 + scratch_bound(7168, 2048, torch.bfloat16, 256)
    with pytest.raises(ValueError, match=r"12\.63 GiB of the GPU's 23\.0 GiB free"):
        check_auto_memory(deepseek_int4, 23 * GIB)
    check_auto_memory(deepseek_int4, 78 * GIB)  # an 80 GB card: the fixed 10% declined it
    free = 78 * GIB
    check_auto_memory(int(AUTO_MAX_FREE_FRACTION * free), free)
    with pytest.raises(ValueError, match="--stream-prefill on"):
        check_auto_memory(int(AUTO_MAX_FREE_FRACTION * free) + 1, free)


def test_after_the_plan_auto_keeps_streaming_where_the_kv_cache_holds_the_context():
    assert kv_room_declines(163_840, 163_840, "one full context", 12 * GIB) is None
    assert kv_room_declines(10**6, 4096, "--kv-cache-tokens", GIB) is None
    reason = kv_room_declines(40_000, 163_840, "one full context", int(12.63 * GIB))
    assert reason == ("streaming's 12.63 GiB would leave the KV cache 40000 tokens, fewer than "
                      "one full context (163840); --stream-prefill on streams anyway")  # fmt: skip


@pytest.mark.parametrize(("device", "tp", "reason"), [
    ("cpu", 1, "streams only to a CUDA device"),
    ("cpu", 2, "not supported with --tensor-parallel-size > 1"),
])  # fmt: skip
def test_auto_declines_before_it_maps_anything(device, tp, reason, caplog):
    """auto on the CPU or with tensor parallelism: no streaming, and the log says why (the
    workers are never asked for their stores: None stands in for them)."""
    with caplog.at_level("INFO", logger="ktserve.gpu"):
        got = build_streaming("auto", None, None, None, torch.device(device), torch.float32, tp)
    assert got is None
    assert reason in caplog.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_the_bytes_judged_are_the_bytes_streaming_holds(fmt, dtype, tmp_path, seed):
    low = open_store(make_store(tmp_path / "low", seed, fmt, range(0, 5))[1])
    high = open_store(make_store(tmp_path / "high", seed + 1, fmt, range(5, E))[1])
    spec = SimpleNamespace(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    stager = LayerStager([low, high], E, torch.device("cpu"))
    try:
        streaming = StreamingExperts(None, stager, H, I, (0, 1), dtype, min_tokens=1)
        held = sum(t.nbytes for slot in stager.slots for t in slot.tensors.values())
        assert streaming.memory_bytes == held + streaming.scratch_bound
        assert streaming_bytes([low, high], spec, dtype) == streaming.memory_bytes
    finally:
        stager.close()
        low.close()
        high.close()
