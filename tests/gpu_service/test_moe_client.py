"""The GPU side's expert client against a real worker: a channel whose shared memory was
overwritten (a slot held though nothing is in flight) is replaced, not left wedged."""

from __future__ import annotations

import ctypes

import torch

from gpu_service.config import ExpertClientConfig
from gpu_service.models import TorchExperts
from gpu_service.moe_client import ShmExperts
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess

HEADER_BYTES, SLOT_HEADER_BYTES = 4096, 512  # ktshm.h
REPLY = 3


def test_a_corrupt_channel_is_replaced_and_calls_go_on(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed)
    reader = CheckpointReader(path)
    spec = reader.spec
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token,
                           wire_dtype="float32", worker_timeout_s=20),
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=16,
    )  # fmt: skip
    try:
        oracle = TorchExperts(reader, "cpu", torch.float32)
        g = torch.Generator().manual_seed(seed)
        layer = spec.moe_layers[0]
        x = torch.randn(5, spec.hidden_size, generator=g)
        ids = torch.randint(0, spec.num_experts, (5, spec.num_experts_per_tok), generator=g,
                            dtype=torch.int32)  # fmt: skip
        weights = torch.rand(5, spec.num_experts_per_tok, generator=g)
        want = oracle.submit(layer, x, ids, weights).wait()
        torch.testing.assert_close(experts.submit(layer, x, ids, weights).wait(), want)
        channel = experts.workers[0].channel
        stride = SLOT_HEADER_BYTES + 2 * channel.region_bytes
        for slot in range(channel.num_slots):  # every slot "holds" a reply nobody asked for
            word = ctypes.c_uint64.from_address(channel.address + HEADER_BYTES + slot * stride)
            word.value = (0xDEAD << 32) | REPLY
        got = experts.submit(layer, x, ids, weights).wait()
        torch.testing.assert_close(got, want)
        assert experts.workers[0].channel is not channel, "the corrupt channel was kept"
        assert experts.alive() == {worker.address: True}
        torch.testing.assert_close(experts.submit(layer, x, ids, weights).wait(), want)
    finally:
        experts.close()
        worker.close()
