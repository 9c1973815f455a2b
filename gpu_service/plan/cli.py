"""`ktserve plan MODEL [flags]`: the memory plan `serve` would make and the decode speed it
predicts, from a checkpoint's config (docs/plan.md)."""

from __future__ import annotations

import argparse
import re

from gpu_service.config import GPU_WEIGHT_FORMATS, KV_CACHE_DTYPES
from ktserve.names import WEIGHT_FORMATS

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}  # fmt: skip
DRAM_MEASURE_GB = 1.0  # the buffer the DRAM rate is measured over when --dram-gbs is not given


def parse_bytes(text: str) -> int:
    """ "24GiB", "192G" (binary), "80GB" (decimal) or a plain number of bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 192G, 80GB)")
    return int(float(found.group(1)) * _UNITS[unit])


def configure_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a checkpoint directory, a GGUF file (only its header is read) or a config.json",
    )
    parser.add_argument(
        "--expert-format",
        choices=WEIGHT_FORMATS,
        default="int8",
        help="routed experts' format in RAM (serve's --format; default %(default)s)",
    )
    parser.add_argument(
        "--gpu-weight-format",
        choices=GPU_WEIGHT_FORMATS,
        default="bf16",
        help="the GPU part's linear layers (default %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's dtype (default %(default)s: the model's)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context to plan the KV cache for (default: the model's own)",
    )
    parser.add_argument(
        "--expert-workers",
        type=int,
        default=1,
        help="CPU expert workers sharing the routed experts (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="the GPU's memory, e.g. 24GiB (default: this machine's GPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="as serve's (default %(default)s)",
    )
    parser.add_argument(
        "--ram",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="host RAM for the experts, e.g. 192GiB (default: MemAvailable here)",
    )
    parser.add_argument(
        "--dram-gbs",
        type=float,
        default=None,
        metavar="GB/S",
        help="the host's DRAM read rate (default: measured here, a second or so)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def local_gpu_memory() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def local_node_memory() -> tuple[int, ...]:
    """This machine's memory per NUMA node (sysfs; empty where it has no node tree)."""
    from ktserve.numa import read_topology

    try:
        return tuple(node.memory_bytes for node in read_topology().nodes)
    except OSError:
        return ()


def run(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    from gpu_service.plan.memory import PlanInputs
    from gpu_service.plan.model_plan import make_plan, read_model_config
    from gpu_service.plan.report import plan_text
    from ktserve.checkpoint import available_memory_bytes
    from ktserve.dram import dram_read_gbs

    hf = read_model_config(args.model)
    gpu_memory = args.gpu_memory if args.gpu_memory is not None else local_gpu_memory()
    inputs = PlanInputs(
        expert_format=args.expert_format,
        gpu_weight_format=args.gpu_weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        expert_workers=args.expert_workers,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_memory=gpu_memory,
        ram=args.ram if args.ram is not None else available_memory_bytes()[0],
    )
    if args.ram is None:
        inputs = replace(inputs, node_memory=local_node_memory())
    measured = args.dram_gbs is None
    dram = dram_read_gbs(os.cpu_count() or 1, DRAM_MEASURE_GB) if measured else args.dram_gbs
    plan = make_plan(hf, inputs, dram, measured)
    print(plan.to_json() if args.json else plan_text(plan))
    if gpu_memory is None and not args.json:
        print("\nno GPU here: pass --gpu-memory (e.g. --gpu-memory 24GiB) to check the fit")
    return 0
