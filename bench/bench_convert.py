"""How fast a checkpoint's routed experts become a worker's packed shard (read, quantize, pack).

Writes a seeded random Hugging Face checkpoint at real shapes (Qwen3-30B-A3B or DeepSeek-V3 MoE
layers, per-expert tensors, bf16 or DeepSeek's FP8 with 128x128 block scales), then converts it
the way `ktserve expert --model DIR` / `ktserve convert` do, each (source, format) in a process
of its own: GB/s of input (the expert tensors' bytes on disk, scales included), and that
process's peak RSS next to the packed shard's size. The checkpoint's files were just written, so
they are read from the page cache; the figure is the conversion's, not the disk's.

    python bench/bench_convert.py [--shape qwen3] [--layers 2] [--sources bf16,fp8]
                                  [--formats int8,int4] [--threads N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from bench.common import Column, print_table


@dataclass(frozen=True)
class Shape:
    model_type: str
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3": Shape("qwen3_moe", 2048, 768, 128, 8),
    "deepseek": Shape("deepseek_v3", 7168, 2048, 256, 8),
}
FP8_BLOCK = 128


def write_checkpoint(out: Path, shape: Shape, layers: int, source: str, seed: int) -> int:
    """A checkpoint of `layers` MoE layers (experts only, one safetensors file per layer);
    returns the bytes of its expert tensors."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": shape.model_type, "num_hidden_layers": layers,
        "hidden_size": shape.hidden, "moe_intermediate_size": shape.inter,
        "num_experts_per_tok": shape.top_k, "vocab_size": 1024, "num_attention_heads": 8,
    }  # fmt: skip
    config["n_routed_experts" if shape.model_type == "deepseek_v3" else "num_experts"] = (
        shape.experts
    )
    if shape.model_type == "deepseek_v3":
        config["first_k_dense_replace"] = 0
    if source == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    nbytes = 0
    for layer in range(layers):
        tensors = {}
        for e in range(shape.experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            for name, rows, cols in (("gate_proj", shape.inter, shape.hidden),
                                     ("up_proj", shape.inter, shape.hidden),
                                     ("down_proj", shape.hidden, shape.inter)):  # fmt: skip
                w = torch.randn(rows, cols, generator=g) * 0.02
                if source == "fp8":
                    blocks = w.view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
                    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [rows/B, cols/B]
                    q = (blocks / scale[:, None, :, None]).view(rows, cols)
                    tensors[f"{prefix}.{name}.weight"] = q.to(torch.float8_e4m3fn)
                    tensors[f"{prefix}.{name}.weight_scale_inv"] = scale.contiguous()
                else:
                    tensors[f"{prefix}.{name}.weight"] = w.to(torch.bfloat16)
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / f"layer-{layer:03d}.safetensors"), metadata={"format": "pt"})
    return nbytes


def convert(model_dir: str, fmt: str, threads: int | None) -> None:
    """In this process: load the shard as a worker does; print seconds, packed bytes and this
    process's peak RSS."""
    from expert_service.shard import load_shard

    start = time.perf_counter()
    shard = load_shard(model_dir, None, fmt, pack_threads=threads)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # NOTE: KiB on Linux
    print(json.dumps({"seconds": seconds, "packed": shard.nbytes, "peak_rss": peak}))


def timed_convert(model_dir: Path, fmt: str, threads: int | None) -> dict:
    argv = [sys.executable, __file__, "--convert-one", str(model_dir), "--formats", fmt]
    if threads:
        argv += ["--threads", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"converting {model_dir} to {fmt} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    p.add_argument("--layers", type=int, default=2, help="MoE layers written (default 2)")
    p.add_argument("--sources", default="bf16,fp8", help="checkpoint dtypes: bf16, fp8")
    p.add_argument("--formats", default="int8,int4", help="packed formats: bf16, int8, int4")
    p.add_argument("--threads", type=int, help="packing threads (default: all cores)")
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--convert-one", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.convert_one:
        convert(args.convert_one, args.formats, args.threads)
        return
    shape, sources = SHAPES[args.shape], args.sources.split(",")
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = []
        for source in sources:
            path = Path(tmp) / source
            t0 = time.perf_counter()
            nbytes = write_checkpoint(path, shape, args.layers, source, args.seed)
            print(f"wrote {nbytes / 1e9:.2f} GB of {source} experts in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
            for fmt in formats:
                r = timed_convert(path, fmt, args.threads)
                rows.append([
                    source, fmt, f"{nbytes / 1e9:.2f}", f"{r['seconds']:.2f}",
                    f"{nbytes / r['seconds'] / 1e9:.2f}", f"{r['packed'] / 2**30:.2f}",
                    f"{r['peak_rss'] / 2**30:.2f}",
                ])  # fmt: skip
    threads = args.threads or len(os.sched_getaffinity(0))
    print(f"conversion of {shape.model_type} experts ({args.layers} layers x {shape.experts} "
          f"experts, H={shape.hidden}, I={shape.inter}), {threads} packing threads")  # fmt: skip
    print_table(
        [Column("source", 6), Column("format", 6), Column("input GB", 8), Column("seconds", 7),
         Column("GB/s in", 7), Column("packed GiB", 10), Column("peak RSS GiB", 12)],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
