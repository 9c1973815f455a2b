"""Decode steps whose expert calls the device makes (device_calls.py), against a real worker.

On the CPU the same calls run from the host (HostStream), in the order the CUDA graph records
them: post layer j's inputs to its device slot, compute the shared expert, collect the reply.
The oracle is the step with the calls made between segments (the path test_decode_graphs checks
against the eager forward) on the same worker, and the eager forward with torch experts.
"""

from __future__ import annotations

import pytest
import torch

from gpu_service.config import ExpertClientConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from gpu_service.experts.device_calls import CudaStream, DeviceCalls, HostStream
from gpu_service.experts.errors import ExpertsUnavailable
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.models import TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import available_families
from tests.support.device_decode import Decoder, free_port, start_worker

FAMILIES = [f for f in ("deepseek_v3", "qwen3_moe") if f in available_families()]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (device, KTSERVE_DEVICE_HANDOFF): on CUDA, both ways of reaching the workers' slots, and the
# kernels keeping their stamps (a benchmark's option: the GPU times the hand-off)
HANDOFFS = [("cpu", "memops")] + (
    [("cuda", "memops"), ("cuda", "kernels"), ("cuda", "kernels+stamps")]
    if torch.cuda.is_available()
    else []
)
BLOCK = 4


def load(path, experts, device: str = "cpu"):
    return load_model(path, device, torch.float32, experts=experts, max_num_tokens_in_cache=512,
                      block_size=BLOCK)  # fmt: skip


CHECKPOINT_FAMILIES = FAMILIES


@pytest.mark.parametrize(("device", "handoff"), HANDOFFS)
def test_device_calls_give_the_logits_of_calls_between_segments(checkpoint, seed, device, handoff):
    """On CUDA the step is one captured graph, its calls stream writes and waits (or Triton
    kernels that read and write the slots); the oracle's steps are graphs of the segments
    between host calls."""
    worker = start_worker(checkpoint, free_port())
    reader = CheckpointReader(checkpoint)
    spec = reader.spec
    stamped = handoff.endswith("+stamps")
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token, wire_dtype="float32",
                           worker_timeout_s=20, device_handoff=handoff.removesuffix("+stamps"),
                           handoff_stamps=stamped),  # fmt: skip
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=64,
        device=device,
    )  # fmt: skip
    try:
        in_graph, between = load(checkpoint, experts, device), load(checkpoint, experts, device)
        eager = load(checkpoint, TorchExperts(reader, device, torch.float32), device)
        capture = device == "cuda"
        graphs = DecodeGraphs(in_graph, DecodeGraphConfig(4, 8, capture))
        assert isinstance(graphs.calls, DeviceCalls)
        assert isinstance(graphs.calls.stream, CudaStream if capture else HostStream)
        assert (graphs.calls.kernels is not None) == handoff.startswith("kernels")
        segmented = DecodeGraphs(between, DecodeGraphConfig(4, 8, capture, experts_in_graph=False))
        assert segmented.calls is None
        reference = DecodeGraphs(eager, DecodeGraphConfig(4, 8, capture=False))
        assert reference.calls is None  # torch experts make no device calls
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (5, 9, 2)]
        decoders = [Decoder(m, d, prompts) for m, d in
                    ((in_graph, graphs), (between, segmented), (eager, reference))]  # fmt: skip
        worst = 0.0
        for step in range(10):  # batch 3 in bucket 4: one padding row per step
            tokens = decoders[2].tokens
            got, want, oracle = (d.step(tokens) for d in decoders)
            assert torch.equal(got, want), f"step {step}: device calls changed the logits"
            worst = max(worst, float((got - oracle).abs().max() / oracle.abs().max()))
        print(f"[device calls {device}] max rel err against torch experts: {worst:.2e}")
        if capture:
            assert graphs.num_graphs >= 1  # each (batch, context) bucket: one graph
        assert worst < 2e-2  # bf16 expert weights against float32 torch experts
        req_bells = [graphs.calls.channels[0].bells(j) for j in range(len(graphs.moes))]
        assert req_bells == [(0, 0)] * len(graphs.moes), "every slot is idle between steps"
        stamps = graphs.calls.handoff_stamps()
        assert (stamps is not None) == stamped
        if stamped:
            check_stamps(stamps[0], steps=10)
    finally:
        experts.close()
        worker.close()


def check_stamps(stamps: torch.Tensor, steps: int) -> None:
    """One worker's stamps [slot, 6] after `steps` steps (device_kernels.py: STAMPS): every slot
    waited once a step (a capture's warm-up runs a step's calls once more), for a positive time;
    every slot after the first also timed the GPU's part since the one before it."""
    from gpu_service.experts.device_kernels import MIDDLE_SUM, MIDDLES, WAIT_SUM, WAITS

    waits = stamps[:, WAITS].tolist()
    assert len(set(waits)) == 1 and waits[0] >= steps, f"waits per slot: {waits}"
    assert (stamps[:, WAIT_SUM] > 0).all()
    assert stamps[0, MIDDLES] == 0 and stamps[0, MIDDLE_SUM] == 0
    assert stamps[1:, MIDDLES].tolist() == waits[1:]
    assert (stamps[1:, MIDDLE_SUM] > 0).all()
    print(f"[stamps] mean wait {stamps[:, WAIT_SUM].sum() / sum(waits) / 1e3:.1f} us a call")


def test_a_worker_restarted_between_steps_serves_the_next_one(checkpoint, seed):
    port = free_port()
    worker = start_worker(checkpoint, port)
    reader = CheckpointReader(checkpoint)
    spec = reader.spec
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token,
                           wire_dtype="float32", worker_timeout_s=30),
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=64,
    )  # fmt: skip
    try:
        model = load(checkpoint, experts)
        graphs = DecodeGraphs(model, DecodeGraphConfig(max_batch=2, min_kv_bucket=8,
                                                       capture=False))  # fmt: skip
        eager = load(checkpoint, TorchExperts(reader, "cpu", torch.float32))
        reference = DecodeGraphs(eager, DecodeGraphConfig(max_batch=2, min_kv_bucket=8,
                                                          capture=False))  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 101, (7,), generator=g).tolist()]
        ours, theirs = Decoder(model, graphs, prompts), Decoder(eager, reference, prompts)
        for _ in range(2):
            tokens = theirs.tokens
            ours.step(tokens), theirs.step(tokens)
        worker.close()  # killed: its heartbeat stops
        worker = start_worker(checkpoint, port, worker.token)
        tokens = theirs.tokens
        got, want = ours.step(tokens), theirs.step(tokens)
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2
        worker.close()
        with pytest.raises(ExpertsUnavailable):  # gone for good: the step fails, clearly
            graphs.calls.timeout_s = 1.0
            graphs.calls.stream.timeout_s = 1.0
            ours.step()
    finally:
        experts.close()
        worker.close()
