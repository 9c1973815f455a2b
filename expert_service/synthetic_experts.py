"""Seeded random packed experts, made in the worker's memory: a benchmark-only weight source.

Real-scale benchmarks (DeepSeek-V3's 256 experts x 58 layers are ~330 GB in int4) need more
routed experts than a disk holds; their values do not change the speed. A checkpoint directory
written by `bench/real_checkpoint.py --experts synthetic` holds the config and the GPU part's
tensors, no routed experts, and MARKER ({"seed": S}); a worker loads such a directory by filling
its packed buffers straight from a seeded generator, far faster than quantizing floats would.
Refused unless ENV is 1 (the benchmarks set it): a served model must never be random weights.

The values make a well-formed model of each format: int4 bytes are any two 4-bit values and its
bf16 group scales positive; int8 weights in [-127, 127] with positive row scales and their true
row sums; bf16 weights of either sign. Weights are 0.01-0.03 in size, as bench/real_checkpoint.py's
(std 0.02).
Each (layer, expert) has its own generator, seeded from (S, layer, expert): the same experts hold
the same values whatever the shard's range or the number of threads.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from expert_service import packed_store
from expert_service.expert_shard import ExpertShard, LoadProgress
from expert_service.kernels import PackedExperts
from ktserve import envs, shared_store
from ktserve.checkpoint import (
    CheckpointError,
    ModelSpec,
    check_memory_available,
    validate_shard,
)
from ktserve.intermediate_split import slice_or_whole
from ktserve.packed_layout import tensor_specs

MARKER = "ktserve-synthetic-experts.json"
ENV = envs.BENCH_SYNTHETIC_EXPERTS.name


class SyntheticExpertsError(CheckpointError):
    """A synthetic-experts directory that cannot be loaded here."""


def is_synthetic_dir(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_marker(model_dir: Path, seed: int) -> None:
    (Path(model_dir) / MARKER).write_text(json.dumps({"seed": int(seed)}))


def load(model_dir: str | Path, experts: range | None, weight_format: str, *,
         threads: int | None = None, progress: LoadProgress | None = None,
         share: bool = False, intermediate: range | None = None) -> ExpertShard:  # fmt: skip
    """The shard's packed layers, filled from the directory's seed (see the module's text).
    intermediate: only these rows of each expert's intermediate dimension (--intermediate-rows:
    packed as experts of that width, never shared; their values are their own, not the rows of
    the whole experts')."""
    model_dir = Path(model_dir)
    if not envs.BENCH_SYNTHETIC_EXPERTS.read():
        raise SyntheticExpertsError(
            f"{model_dir} holds synthetic (random) experts, a benchmark-only weight source: "
            f"set {ENV}=1 to load it (the benchmarks under bench/ do), or serve a real checkpoint"
        )
    seed = int(json.loads((model_dir / MARKER).read_text())["seed"])
    spec = ModelSpec.from_checkpoint(model_dir)
    experts = experts if experts is not None else range(spec.num_experts)
    validate_shard(spec, experts)
    intermediate = slice_or_whole(intermediate, spec.moe_intermediate_size)
    share = share and intermediate is None  # NOTE: a GPU service maps whole experts
    H, I = spec.hidden_size, len(intermediate or range(spec.moe_intermediate_size))  # noqa: E741
    if H % 64 or I % 64:
        raise SyntheticExpertsError(
            f"synthetic experts need hidden and moe_intermediate sizes that are multiples of 64 "
            f"(no padding to keep zero), got {H} and {I}"
        )
    specs = tensor_specs(weight_format, H, I)
    required = len(spec.moe_layers) * len(experts) * sum(d.itemsize * n for d, n in specs.values())
    check_memory_available(required)
    store_dir = shared_store.create(required) if share else None
    pool = ThreadPoolExecutor(max_workers=threads or max(1, len(os.sched_getaffinity(0))))

    def pack_layer(layer: int, out: dict | None) -> PackedExperts:
        if out is None:
            out = {n: np.empty((len(experts), per), dtype) for n, (dtype, per) in specs.items()}
        fill = partial(fill_expert, out, weight_format, H, I)
        list(pool.map(fill, range(len(experts)), [(seed, layer, e) for e in experts]))
        return PackedExperts.from_tensors(weight_format, len(experts), H, I, out)

    try:
        layers, store = packed_store.pack_layers(spec, model_dir, experts, weight_format,
                                                 store_dir, pack_layer, progress)  # fmt: skip
    finally:
        pool.shutdown()
    return ExpertShard(spec, str(model_dir), weight_format, experts, layers, store, intermediate)


def fill_expert(out: dict[str, np.ndarray], fmt: str, H: int, I: int, j: int,  # noqa: E741
                seed: tuple[int, int, int]) -> None:  # fmt: skip
    """Expert row j of every packed buffer in `out`, from the generator of `seed`: random bytes,
    then bit masks that make each value what its format needs (integer work only, where
    quantizing floats would be float work per value)."""
    gen = np.random.SFC64(np.random.SeedSequence(list(seed)))
    row = {name: buf[j] for name, buf in out.items()}  # [elements per expert]
    for name in sorted(row):  # NOTE: in one order, however `out` was built
        if not name.startswith("r"):  # int8's row sums: computed below
            _random_bytes(gen, row[name].view(np.uint8))
    if fmt == "bf16":  # sign and mantissa random, |w| in [2^-6, 2^-5)
        for name in ("w13", "w2"):
            _set_exponent(row[name], 0x807F, 127 - 6, 7)
        return
    if fmt == "int4":  # any byte is two 4-bit values; bf16 scales in [2^-8, 2^-7)
        for name in ("s13", "s2"):
            _set_exponent(row[name], 0x007F, 127 - 8, 7)
        return
    for name, k in (("13", H), ("2", I)):  # int8 in [-127, 127]; fp32 scales in [2^-12, 2^-11)
        q = row[f"w{name}"]
        np.maximum(q, -127, out=q)
        _set_exponent(row[f"s{name}"].view(np.uint32), 0x007FFFFF, 127 - 12, 23)
        sums = q.reshape(-1, k // 4, 16, 4).sum(axis=(1, 3), dtype=np.int32)  # [blocks, 16]
        row[f"r{name}"][:] = sums.reshape(-1)


_CHUNK_WORDS = 1 << 17  # 1 MiB of random words at a time: generated in cache, then copied


def _random_bytes(gen: np.random.SFC64, out: np.ndarray) -> None:
    """Fill the uint8 array `out` from the bit generator."""
    n = out.size
    for start in range(0, n, 8 * _CHUNK_WORDS):
        m = min(8 * _CHUNK_WORDS, n - start)
        out[start : start + m] = gen.random_raw(-(-m // 8)).view(np.uint8)[:m]


def _set_exponent(bits: np.ndarray, keep: int, exponent: int, shift: int) -> None:
    """Floating-point bit patterns: keep the `keep` bits (sign and/or mantissa), set the biased
    exponent, so every value is finite and in [2^(e-bias), 2^(e-bias+1))."""
    bits &= bits.dtype.type(keep)
    bits |= bits.dtype.type(exponent << shift)
