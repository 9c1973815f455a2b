"""The whole plan of one model: its memory (memory.py), its decode speed (decode.py), and the
flags that would make it fit where it does not."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpu_service.models.config import model_max_len
from gpu_service.plan.decode import MEASURED_SHARE_OF_BOUND, DecodePrediction, predict_decode
from gpu_service.plan.gpu_tensors import gpu_tensors
from gpu_service.plan.memory import MemoryEstimate, PlanInputs, estimate_memory
from ktserve.checkpoint import HFConfig, InvalidConfig, ModelSpec

SUGGESTED_CONTEXT_STEP = 1024  # a suggested --max-model-len is rounded down to a multiple


@dataclass(frozen=True)
class Plan:
    model: str
    family: str
    gpu_params: int  # the GPU part's parameters
    routed_params: int  # routed experts', all layers
    num_moe_layers: int
    model_max_len: int
    inputs: PlanInputs
    memory: MemoryEstimate
    dram_gbs: float
    dram_measured: bool  # False: --dram-gbs
    decode: tuple[DecodePrediction, ...]
    suggestions: tuple[str, ...]

    def to_json(self) -> str:
        data = asdict(self)
        memory = data["memory"]
        memory.update(gpu_total=self.memory.gpu_total, host_total=self.memory.host_total,
                      gpu_fits=self.memory.gpu_fits, host_fits=self.memory.host_fits,
                      nodes_fit=self.memory.nodes_fit)  # fmt: skip
        return json.dumps(data, indent=2)


def read_model_config(model: str | Path) -> HFConfig:
    """config.json of a checkpoint directory, a GGUF file (its metadata only) or a config.json
    file given alone."""
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidConfig(path, f"not readable JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise InvalidConfig(path, "the top level is not a JSON object")
        return HFConfig(data, str(path))
    return HFConfig.from_checkpoint(path)


def make_plan(hf: HFConfig, inputs: PlanInputs, dram_gbs: float, dram_measured: bool) -> Plan:
    spec = ModelSpec.from_hf(hf)
    max_len = model_max_len(hf)
    memory = estimate_memory(hf, inputs, max_len)
    decode = tuple(
        predict_decode(batch, spec.num_experts, spec.num_experts_per_tok, memory.expert_bytes,
                       spec.num_moe_layers, dram_gbs)
        for batch in sorted(MEASURED_SHARE_OF_BOUND)
    )  # fmt: skip
    return Plan(
        model=hf.source,
        family=spec.family,
        gpu_params=sum(t.num_params for t in gpu_tensors(hf)),
        routed_params=spec.expert_num_params * spec.num_experts * spec.num_moe_layers,
        num_moe_layers=spec.num_moe_layers,
        model_max_len=max_len,
        inputs=inputs,
        memory=memory,
        dram_gbs=dram_gbs,
        dram_measured=dram_measured,
        decode=decode,
        suggestions=suggestions(hf, inputs, memory, max_len),
    )


def suggestions(hf: HFConfig, inputs: PlanInputs, memory: MemoryEstimate,
                max_len: int) -> tuple[str, ...]:  # fmt: skip
    """Flags that make the plan fit, cheapest in quality first: FP8 GPU weights, an FP8 KV
    cache, both, or prefill on the workers (serve's --stream-prefill auto gives streaming up
    itself where it crowds the KV cache); then the longest --max-model-len that fits; int4
    experts where RAM is short."""
    found = []
    if memory.gpu_fits is False:
        tries = []
        if inputs.gpu_weight_format == "bf16":
            tries.append(({"gpu_weight_format": "fp8"}, "--gpu-weight-format fp8"))
        if inputs.kv_cache_dtype == "auto":
            tries.append(({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"))
        if len(tries) == 2:
            both = {**tries[0][0], **tries[1][0]}
            tries.append((both, f"{tries[0][1]} {tries[1][1]}"))
        if inputs.stream_prefill:
            tries.append(({"stream_prefill": False}, "--stream-prefill off"))
        for change, flags in tries:
            if estimate_memory(hf, replace(inputs, **change), max_len).gpu_fits:
                found.append(flags)
                break
        largest = memory.largest_context or 0
        step = SUGGESTED_CONTEXT_STEP
        if largest > 0:
            found.append(
                f"--max-model-len {largest // step * step if largest >= step else largest}"
            )
    int4 = replace(inputs, expert_format="int4")
    short = memory.host_fits is False or memory.nodes_fit is False
    int4_memory = estimate_memory(hf, int4, max_len)
    if short and int4_memory.host_fits is not False and int4_memory.nodes_fit is not False:
        found.append("--expert-format int4")
    return tuple(found)
