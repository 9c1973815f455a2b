"""The plan as plain text: the GPU parts against the budget, the host RAM per worker, the
context that fits, the decode speed, and the flags that would make it fit."""

from __future__ import annotations

from gpu_service.plan.memory import ESTIMATED_PARTS, GPU_PARTS
from gpu_service.plan.model_plan import Plan

GIB = 2**30


def _fits(value: bool | None) -> str:
    return {True: "fits", False: "does NOT fit", None: "not checked"}[value]


def plan_text(plan: Plan) -> str:
    mem, inputs = plan.memory, plan.inputs
    lines = [
        f"ktserve plan: {plan.model} ({plan.family})",
        f"  GPU part {plan.gpu_params / 1e9:.2f} B params ({inputs.gpu_weight_format}); routed "
        f"experts {plan.routed_params / 1e9:.2f} B params in {plan.num_moe_layers} MoE layers "
        f"({inputs.expert_format} on the CPU workers)",
        "",
        f"GPU memory (--gpu-memory-utilization {inputs.gpu_memory_utilization}"
        + (
            f" of {inputs.gpu_memory / GIB:.2f} GiB = {mem.gpu_budget / GIB:.2f} GiB budget)"
            if mem.gpu_budget is not None
            else ", no GPU memory given)"
        ),  # fmt: skip
        f"  {'part':<18} {'GiB':>9}",
    ]
    for part in GPU_PARTS:
        note = "  (estimate)" if part in ESTIMATED_PARTS else ""
        if part == "kv_cache":
            note = (f"  ({mem.context} tokens x {mem.kv_bytes_per_token} B, "
                    f"kv {inputs.kv_cache_dtype})")  # fmt: skip
        lines.append(f"  {part:<18} {mem.gpu_parts[part] / GIB:9.3f}{note}")
    lines.append(f"  {'total':<18} {mem.gpu_total / GIB:9.3f}  {_fits(mem.gpu_fits)}")
    if mem.largest_context is not None:
        lines.append(f"  largest context that fits: {mem.largest_context} tokens "
                     f"(model max {plan.model_max_len})")  # fmt: skip
    lines += ["", f"Host RAM for the routed experts ({inputs.expert_workers} worker(s), "
              f"{mem.expert_bytes / 2**20:.2f} MiB an expert)"]  # fmt: skip
    nodes = mem.node_memory if mem.nodes_fit is not None else ()
    for i, nbytes in enumerate(mem.worker_expert_bytes):
        node = f" of node {i}'s {nodes[i] / GIB:.2f} GiB" if nodes else ""
        lines.append(f"  worker {i:<11} {nbytes / GIB:9.3f}{node}")
    if mem.nodes_fit is not None:
        lines.append(f"  one worker a NUMA node (--numa auto): {_fits(mem.nodes_fit)}")
    ram = f" of {mem.ram / GIB:.2f} GiB" if mem.ram is not None else ""
    lines.append(f"  {'total':<18} {mem.host_total / GIB:9.3f}{ram}  {_fits(mem.host_fits)}")
    source = "measured here" if plan.dram_measured else "given"
    lines += ["", f"Decode (DRAM {plan.dram_gbs:.1f} GB/s, {source}; uniform routing)"]
    lines.append(f"  {'batch':>5} {'GB/token':>10} {'bound tok/s':>12} {'share':>6} {'tok/s':>8}")
    for d in plan.decode:
        gb = d.routed_bytes_per_token / 1e9
        lines.append(f"  {d.batch:>5} {gb:10.3f} {d.bound_tok_s:12.1f} "
                     f"{d.share_of_bound:6.0%} {d.predicted_tok_s:8.1f}")  # fmt: skip
    if plan.suggestions:
        lines += ["", "To fit: " + "; or ".join(plan.suggestions)]
    return "\n".join(lines)
