"""The plan of every family's tiny checkpoint against what is then built on the CPU: the GPU
part's bytes per weight format and the KV cache's bytes per token of the model `serve` loads,
the host bytes of real `ktserve expert` workers; a GGUF's plan from its header alone."""

from __future__ import annotations

import gguf
import pytest
import torch

from gpu_service.layers.weight_formats import LinearQuantConfig
from gpu_service.memory_plan import weight_bytes
from gpu_service.models import TorchExperts, load_model
from gpu_service.plan.memory import PlanInputs
from gpu_service.plan.model_plan import make_plan, read_model_config
from gpu_service.workers.plan import split_experts
from ktserve.checkpoint import CheckpointReader, ModelSpec
from ktserve.protocol import expert_pb2 as pb
from tests.support.checkpoints import available_families, make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess
from tests.support.gguf_checkpoints import GGUF_OVERRIDES, write_gguf

TOLERANCE = 0.02


def plan_of(path, **inputs):
    inputs.setdefault("model_dtype", "float32")  # NOTE: the CPU's model dtype
    return make_plan(read_model_config(path), PlanInputs(**inputs), 100.0, dram_measured=False)


@pytest.mark.parametrize("family", available_families())
def test_plan_matches_the_gpu_part_the_cpu_loads(family, tmp_path, seed):
    path = make_tiny_checkpoint(family, tmp_path / family, seed=seed)
    experts = TorchExperts(CheckpointReader(path), "cpu", torch.float32)
    for fmt in ("bf16", "int8", "int4"):
        quant = LinearQuantConfig(fmt)
        model = load_model(path, "cpu", torch.float32, experts=experts,
                           max_num_tokens_in_cache=64, linear_quant=quant)  # fmt: skip
        plan = plan_of(path, gpu_weight_format=fmt)
        held, planned = weight_bytes(model), plan.memory.gpu_parts["weights"]
        print(f"{family} {fmt}: held {held} B, planned {planned} B")
        assert planned == pytest.approx(held, rel=TOLERANCE)
        per_token = model.kv_cache.config.bytes_per_token(torch.float32)
        assert plan.memory.kv_bytes_per_token == per_token


def test_plan_matches_the_experts_real_workers_hold(tmp_path, seed):
    """Two workers of the even split (--expert-workers 2), each started on its range."""
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed)
    num_experts = ModelSpec.from_checkpoint(path).num_experts
    for fmt in ("int8", "int4"):
        plan = plan_of(path, expert_format=fmt, expert_workers=2)
        held = []
        for span in split_experts(num_experts, 2):
            worker = ExpertProcess("--model", str(path), "--format", fmt, "--experts", span)
            try:
                held.append(worker.stub.GetInfo(pb.GetInfoRequest(), timeout=30).weight_bytes)
            finally:
                worker.close()
        print(f"{fmt}: held {held}, planned {plan.memory.worker_expert_bytes}")
        assert held == pytest.approx(list(plan.memory.worker_expert_bytes), rel=TOLERANCE)


@pytest.mark.parametrize("family", tuple(GGUF_OVERRIDES))
def test_a_gguf_is_planned_from_its_header_alone(family, tmp_path, seed):
    checkpoint = make_tiny_checkpoint(family, tmp_path / "hf", seed=seed, **GGUF_OVERRIDES[family])
    first, _ = write_gguf(checkpoint, tmp_path / "m.gguf", seed=seed)
    data_offset = gguf.GGUFReader(first).data_offset
    # NOTE: every tensor byte overwritten (NaN or garbage for each type): the plan must come
    # from the header alone. (Truncating the data instead is refused on open: the container
    # checks each tensor's extent against the file's size.)
    size = first.stat().st_size
    with open(first, "r+b") as f:
        f.seek(data_offset)
        f.write(b"\xff" * (size - data_offset))
    of_gguf, of_dir = plan_of(first), plan_of(checkpoint)
    print(f"{family}: GGUF GPU part {of_gguf.gpu_params}, routed {of_gguf.routed_params}")
    assert (of_gguf.family, of_gguf.gpu_params, of_gguf.routed_params) == (
        of_dir.family, of_dir.gpu_params, of_dir.routed_params)  # fmt: skip
    assert of_gguf.memory.kv_bytes_per_token == of_dir.memory.kv_bytes_per_token
