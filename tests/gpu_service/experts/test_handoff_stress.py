"""The device's expert calls under timing pressure: hundreds of decode steps (30 without a
GPU) whose expert calls the device makes, against a worker that replies at once and one that
holds each reply back a random 0..400 us (expert_service/worker.py: REPLY_DELAY_ENV), at
several batch sizes and both wire dtypes; every step's logits must equal, bit for bit, those
of the same steps with the calls made between segments (test_decode_graphs checks that path
against the eager forward). On CUDA both hand-offs run (the Triton kernels: issue 43); on the
CPU the host makes the same calls in the graph's order (HostStream)."""

from __future__ import annotations

import pytest
import torch

from expert_service.worker import REPLY_DELAY_ENV, REPLY_DELAY_SEED_ENV
from gpu_service.config import ExpertClientConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from gpu_service.experts.device_calls import DeviceCalls
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.models import load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import available_families
from tests.support.device_decode import Decoder
from tests.support.expert_procs import ExpertProcess

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FAMILIES = [f for f in ("deepseek_v3", "qwen3_moe") if f in available_families()]
HANDOFFS = ["memops", "kernels"] if CUDA else ["memops"]
STEPS = 200 if CUDA else 30
REPLY_DELAYS_US = {"instant": 0, "delayed": 400}
BLOCK = 16


CHECKPOINT_FAMILIES = FAMILIES


@pytest.fixture(scope="module", params=list(REPLY_DELAYS_US))
def worker(request, checkpoint, seed):
    env = {REPLY_DELAY_ENV: str(REPLY_DELAYS_US[request.param]), REPLY_DELAY_SEED_ENV: str(seed)}
    process = ExpertProcess("--model", str(checkpoint), "--format", "bf16", env=env)
    yield process
    process.close()


def load(path, experts, num_tokens: int):
    return load_model(path, DEVICE, torch.float32, experts=experts,
                      max_num_tokens_in_cache=num_tokens, block_size=BLOCK)  # fmt: skip


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 6])  # buckets 1, 4 and 8: 0, 1 and 2 padding rows
@pytest.mark.parametrize("handoff", HANDOFFS)
def test_every_step_gives_the_logits_of_calls_between_segments(
    checkpoint, worker, handoff, batch, wire_dtype, seed
):
    spec = CheckpointReader(checkpoint).spec
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token, wire_dtype=wire_dtype,
                           worker_timeout_s=30, device_handoff=handoff),  # fmt: skip
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=128,
        device=DEVICE,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + batch)
    prompts = [torch.randint(0, 101, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 14, (batch,), generator=g)]  # fmt: skip
    num_tokens = batch * (max(map(len, prompts)) + STEPS + BLOCK)
    try:
        in_graph, between = load(checkpoint, experts, num_tokens), load(checkpoint, experts,
                                                                          num_tokens)  # fmt: skip
        config = dict(max_batch=8, min_kv_bucket=64, capture=CUDA)
        graphs = DecodeGraphs(in_graph, DecodeGraphConfig(**config))
        assert isinstance(graphs.calls, DeviceCalls)
        assert (graphs.calls.kernels is not None) == (handoff == "kernels")
        segmented = DecodeGraphs(between, DecodeGraphConfig(**config, experts_in_graph=False))
        decoders = [Decoder(in_graph, graphs, prompts), Decoder(between, segmented, prompts)]
        for step in range(STEPS):
            tokens = decoders[1].tokens
            got, want = (d.step(tokens) for d in decoders)
            if not torch.equal(got, want):
                rows = (got != want).any(dim=1).nonzero().flatten().tolist()
                raise AssertionError(
                    f"step {step}: the device's calls changed the logits of rows {rows} of "
                    f"{batch} (max difference {float((got - want).abs().max()):.3g})"
                )
        bells = [graphs.calls.channels[0].bells(j) for j in range(len(graphs.moes))]
        assert bells == [(0, 0)] * len(graphs.moes), "every slot is idle between steps"
        print(f"[{handoff} batch {batch} {wire_dtype}] {STEPS} steps bit for bit")
    finally:
        experts.close()
