"""kt-kernel (KTransformers' CPU MoE kernels, AMX int8/int4) as a peer for bench_moe_kernel.py.

kt-kernel is no dependency of ktserve: it is used when `kt_kernel` is importable (installed, or its
package directory on PYTHONPATH) on a CPU with AMX. Peer formats (FORMATS):

- int8, int4: AMXInt8_MOE / AMXInt4_MOE, built the way its online-quantizing loader does it: raw
  bf16 gate/up [E, I, H] and down [E, H, I] pointers in a MOEConfig with save=False, load=False (so
  nothing is written to disk), then load_weights_task quantizes them (one scale per output row).
- int4g32: AMXInt4_KGroup_MOE (C++ AMX_K2_MOE_TP<GemmKernel224Int4SmallKGroup>, its "RAWINT4"
  method for Kimi-K2's compressed-tensors int4 checkpoints), which takes pre-quantized weights only:
  we quantize the bf16 weights here (quantize_rawint4: symmetric int4 per group of 32 along K, the
  compressed-tensors convention) and hand it per-expert pointers, as its NativeMoEWrapper does
  (MOEConfig.gate_projs / gate_scales = [[one pointer per expert]], quant_config bits 4, group_size
  32, zero_point False); load_weights_task copies each expert into its own buffers, so no file is
  written and the pointers may repeat a few seed experts. Compared with our int4 (group 32).

forward_task takes qlen as a pointer to an int32, expert ids int64 [T, k], weights f32 [T, k], x
bf16 [T, H] -> out bf16 [T, H]; a task is handed to CPUInfer.submit and waited for with
CPUInfer.sync.

Threads: CPUInfer(WorkerPoolConfig) with one subpool of N threads runs N compute threads (its
NUMA-job thread as worker 0 plus N - 1 pool threads, pinned to cores 0..N-1 of NUMA node 0), plus
its task-queue thread, which busy-waits on them during a call; the caller sleeps in sync(). Ours
counts the caller as one of its N. Its pool threads spin 50 ms after a call before they sleep.

    python bench/peers/kt_kernel.py --selfcheck [--threads 4] [--formats int8,int4,int4g32]
    python bench/peers/kt_kernel.py --check-packer     # pure torch, runs anywhere

--selfcheck checks kt-kernel's forward (each format, T = 1, 4, 32: its decode and prefill paths) on
a small layer against the plain torch fp32 MoE (tests.support.reference_moe) over the same bf16
weights and prints the relative errors, with ours beside them when expert_service's kernel imports
(int4g32 beside our int4); it first runs --check-packer, which unpacks our RAWINT4 packing the way
kt-kernel reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# peer format -> kt_kernel_ext.moe class
FORMATS = {"int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE", "int4g32": "AMXInt4_KGroup_MOE"}
OURS = {"int8": "int8", "int4": "int4", "int4g32": "int4"}  # our format each is compared with
RAWINT4 = ("int4g32",)  # formats built from pre-quantized weights (build_rawint4_layer)
RAWINT4_GROUP = 32
# relative L2 error against the fp32 MoE; a wrong call or layout gives ~1 or more. int4g32 has our
# int4's format (0.17-0.19 there), so a tighter limit than int4's per-row scales (0.23-0.26)
SELFCHECK_LIMIT = {"int8": 0.05, "int4": 0.4, "int4g32": 0.3}
MEM_MARGIN = 4 << 30  # bytes left free when building layers


@dataclass(frozen=True)
class KtKernel:
    ext: Any  # the kt_kernel_ext extension module
    how: str  # how it was loaded
    formats: tuple[str, ...]  # the FORMATS whose class its extension has

    def skip_line(self, fmt: str) -> str:
        """Empty when fmt is usable, else one line saying why it is skipped."""
        if fmt in self.formats:
            return ""
        return f"kt-kernel {fmt}: skipped: its extension has no moe.{FORMATS[fmt]}"


@dataclass(frozen=True)
class RawInt4Experts:
    """Experts in kt-kernel's RAWINT4 layout (see quantize_rawint4), one (packed, scales) pair
    per projection: gate, up uint8 [E, I, H/2] + bf16 [E, I, H/32]; down [E, H, I/2] + [E, H, I/32].
    """

    gate: tuple[torch.Tensor, torch.Tensor]
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]

    @property
    def num_experts(self) -> int:
        return self.gate[0].shape[0]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.gate, *self.up, *self.down)


@dataclass(frozen=True)
class KtLayer:
    fmt: str
    moe: Any
    config: Any
    keep: tuple[torch.Tensor, ...]  # buffers whose pointers the config holds


@dataclass(frozen=True)
class KtInputs:
    qlen: torch.Tensor  # int32 [1]
    ids: torch.Tensor  # int64 [T, k]
    weights: torch.Tensor  # f32 [T, k]
    x: torch.Tensor  # bf16 [T, H]
    out: torch.Tensor  # bf16 [T, H]


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return {"amx_tile", "amx_int8"} <= set(line.split(":", 1)[1].split())
    except OSError:
        return False
    return False


def _so_mismatch(pkg_dir: str) -> str:
    """Why the package's extensions cannot load in this interpreter ("" when one might)."""
    sos = glob.glob(os.path.join(pkg_dir, "*kt_kernel_ext*.so"))
    if not sos:
        return f"no kt_kernel_ext*.so in {pkg_dir}"
    own = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-312-x86_64-linux-gnu.so
    if any(so.endswith((own, ".abi3.so")) or ".cpython-" not in so for so in sos):
        return ""
    names = ", ".join(sorted(os.path.basename(s) for s in sos))
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"its extension ({names}) is not built for this Python {py}"


def _load_amx_so(pkg_dir: str) -> Any:
    """The AMX extension loaded directly, as kt_kernel's own loader does (no package import)."""
    mod = sys.modules.get("kt_kernel_ext")
    if mod is not None and hasattr(mod, "moe"):  # a failed `import kt_kernel` may have loaded it
        return mod
    sos = glob.glob(os.path.join(pkg_dir, "_kt_kernel_ext_amx.*.so"))
    sos += glob.glob(os.path.join(pkg_dir, "kt_kernel_ext.*.so"))
    if not sos:
        raise ImportError(f"no _kt_kernel_ext_amx.*.so in {pkg_dir}")
    spec = importlib.util.spec_from_file_location("kt_kernel_ext", sos[0])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {sos[0]}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_kt_kernel() -> tuple[KtKernel | None, str]:
    """(kt-kernel, "") when usable here, else (None, one line saying why)."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None, "kt_kernel is not importable (not installed and not on PYTHONPATH)"
    pkg_dir = list(spec.submodule_search_locations)[0]
    mismatch = _so_mismatch(pkg_dir)
    if mismatch:
        return None, f"kt_kernel at {pkg_dir}: {mismatch}"
    if not cpu_has_amx():
        return None, "this CPU has no AMX (amx_tile/amx_int8), which AMXInt8_MOE/AMXInt4_MOE need"
    try:
        import kt_kernel

        ext, how = kt_kernel.kt_kernel_ext, f"import kt_kernel ({pkg_dir})"
    except Exception as e:  # the package imports optional modules (gguf, ...) at import time
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        try:
            ext = _load_amx_so(pkg_dir)
        except Exception as e2:
            return None, f"import kt_kernel failed ({why}); loading its .so failed too ({e2})"
        how = f"its AMX extension loaded directly (import kt_kernel failed: {why})"
    have = tuple(f for f, cls in FORMATS.items() if hasattr(ext.moe, cls))
    variant = getattr(ext, "__cpu_variant__", "?")
    if not have or variant != "amx":
        missing = [c for f, c in FORMATS.items() if f not in have]
        return None, f"kt_kernel_ext variant {variant!r} (lacks {missing or 'none'})"
    int8_kernel = getattr(ext, "__int8_kernel__", "?")
    return KtKernel(ext, f"{how}, variant {variant}, int8 kernel {int8_kernel}", have), ""


@contextlib.contextmanager
def c_stdout_captured() -> Iterator[list[str]]:
    """Captures what C/C++ code prints to fd 1 (kt-kernel logs every layer it builds)."""
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield text
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace"))


def expert_nbytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one expert in kt-kernel's buffers: n*k (int8) or n*k/2 (int4) + an f32 per row;
    int4g32: n*k/2 + an f32 per group of 32 (BufferBInt4KGroupImpl keeps its scales as f32)."""
    if fmt in RAWINT4:
        return 3 * hidden * inter // 2 + 4 * (3 * hidden * inter // RAWINT4_GROUP)
    per = {"int8": 1.0, "int4": 0.5}[fmt]
    return int(3 * hidden * inter * per) + 4 * (2 * inter + hidden)


def rawint4_expert_nbytes(hidden: int, inter: int) -> int:
    """Bytes of one expert in the RAWINT4 source layout (int4 nibbles + a bf16 per group)."""
    return 3 * hidden * inter // 2 + 2 * (3 * hidden * inter // RAWINT4_GROUP)


def quantize_rawint4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] weights -> kt-kernel's RAWINT4: packed uint8 [..., N, K/2], bf16 [..., N, K/32].

    The compressed-tensors int4 "pack-quantized" convention of Kimi-K2's checkpoints: symmetric, one
    scale per group of 32 along K, scale = amax / 7.5 (its bit range 15 / 2; rounded to bf16 and
    quantized with that bf16 value), q = clamp(round(w / scale), -8, 7), no zero point; stored as
    the nibble q + 8, byte j of a row holding k = 2j in its low nibble and k = 2j + 1 in its high
    one. (The checkpoint's int32 [N, K/8], with k = 8c + i at bits 4i of word c, read as
    little-endian bytes, is the same bytes: that is how kt-kernel's loader feeds it.)
    """
    *lead, N, K = w.shape  # noqa: N806
    if K % (2 * RAWINT4_GROUP):
        raise ValueError(f"K={K} must be a multiple of {2 * RAWINT4_GROUP}")
    g = w.detach().float().reshape(-1, N, K // RAWINT4_GROUP, RAWINT4_GROUP)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float32).eps).bfloat16()
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int16) + 8
    q = q.to(torch.uint8).reshape(-1, N, K)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed.reshape(*lead, N, K // 2).contiguous(), scale.reshape(*lead, N, -1).contiguous()


def unpack_rawint4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The f32 weights [..., N, K] kt-kernel reads from RAWINT4 (value = nibble - 8, low nibble =
    even k, high = odd k, times the bf16 scale of the k's group of 32)."""
    lo = (packed & 0x0F).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    q = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return q.float() * scales.float().repeat_interleave(RAWINT4_GROUP, dim=-1)


def quantize_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> RawInt4Experts:
    return RawInt4Experts(quantize_rawint4(gate), quantize_rawint4(up), quantize_rawint4(down))


def check_rawint4_packer() -> list[str]:
    """Pure-torch checks of quantize_rawint4 against kt-kernel's layout; [] when all pass."""
    bad: list[str] = []
    # a hand-packed row: amax 7.5 -> scale 1.0 exactly; -7.5, 7, 0, -1, 7.5 -> q = -8, 7, 0, -1, 7
    # (7.5 rounds to 8, clamped) -> nibbles 0, 15, 8, 7, 15 -> bytes 0xF0, 0x78, then 0x8F (7.5, 0)
    w = torch.zeros(32, 64)
    w[0, :5] = torch.tensor([-7.5, 7.0, 0.0, -1.0, 7.5])
    packed, scales = quantize_rawint4(w)
    got = unpack_rawint4(packed, scales)[0, :6].tolist()
    if float(scales[0, 0]) != 1.0 or got != [-8.0, 7.0, 0.0, -1.0, 7.0, 0.0]:
        bad.append(f"hand row: scale {float(scales[0, 0])}, unpacked {got}")
    if packed[0, :3].tolist() != [0xF0, 0x78, 0x8F]:
        bad.append(f"hand row: bytes {[hex(b) for b in packed[0, :3].tolist()]}, want f0 78 8f")
    if packed.shape != (32, 32) or packed.dtype != torch.uint8 or scales.shape != (32, 2):
        bad.append(f"shapes {tuple(packed.shape)} {packed.dtype}, scales {tuple(scales.shape)}")
    if scales.dtype != torch.bfloat16 or float(scales[1, 0]) <= 0:  # an all-zero group: eps scale
        bad.append(f"scales {scales.dtype}, all-zero group's {float(scales[1, 0])}")
    # random experts [E, N, K]: round trip, error bound, the checkpoint's int32 words
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 64, 256, generator=gen) * 0.02).bfloat16()
    w[1, 3, 40] = 0.5  # an outlier in one group
    packed, scales = quantize_rawint4(w)
    s = scales.float().repeat_interleave(RAWINT4_GROUP, dim=-1)
    q = torch.round(w.float() / s).clamp(-8, 7)
    deq = unpack_rawint4(packed, scales)
    if not torch.equal(deq, q * s):
        bad.append(f"round trip: max |unpacked - q*scale| {float((deq - q * s).abs().max())}")
    # half a step, plus for the clamped +amax what the bf16 rounding of amax / 7.5 adds (<= 2^-8)
    over = (deq - w.float()).abs() - (0.5 + 7.5 / 256) * s
    if float(over.max()) > 0:
        bad.append(f"dequantized error above half a step by {float(over.max())}")
    words = torch.zeros(3, 64, 256 // 8, dtype=torch.int64)
    for i in range(8):  # compressed-tensors pack_to_int32: k = 8c + i at bits 4i of word c
        words |= (q[..., i::8].to(torch.int64) + 8) << (4 * i)
    as_bytes = words.numpy().astype("<u4").view("u1").reshape(3, 64, 128)  # little-endian
    if not torch.equal(torch.from_numpy(as_bytes), packed):
        bad.append("the checkpoint's int32 words read as bytes differ from the packed bytes")
    rel = float((deq - w.float()).norm() / w.float().norm())
    if not 0.02 < rel < 0.15:
        bad.append(f"relative weight error {rel:.4f} outside 0.02-0.15")
    return bad


def tiled_bf16(seed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts, ...] bf16 whose experts repeat the seed experts (in distinct memory)."""
    out = torch.empty((num_experts, *seed.shape[1:]), dtype=torch.bfloat16)
    for i in range(0, num_experts, seed.shape[0]):
        n = min(seed.shape[0], num_experts - i)
        out[i : i + n].copy_(seed[:n])
    return out


class KtPeer:
    """One kt-kernel CPUInfer (its thread pool) for the process, and layers built on it."""

    def __init__(self, kt: KtKernel, threads: int) -> None:
        self.ext = kt.ext
        self.formats = kt.formats  # the FORMATS its extension has
        self.threads = threads
        pool = self.ext.WorkerPoolConfig()
        pool.subpool_count = 1
        pool.subpool_numa_map = [0]
        pool.subpool_thread_count = [threads]
        with c_stdout_captured():
            self.cpu = self.ext.CPUInfer(pool)

    def _config(self, E: int, top_k: int, H: int, I: int, layer_idx: int, max_tokens: int):  # noqa: E741, N803
        """A MOEConfig on this pool; (config, buffers its pointers refer to)."""
        mask = torch.zeros(E, dtype=torch.uint8)  # no expert on a GPU
        config = self.ext.moe.MOEConfig(E, top_k, H, I, 0)
        config.gpu_experts_mask = mask.data_ptr()
        config.layer_idx = layer_idx
        config.pool = self.cpu.backend_
        config.max_len = max_tokens
        config.save = False
        config.load = False
        return config, (mask,)

    def _load(self, fmt: str, config: Any, E: int, keep: tuple[torch.Tensor, ...]) -> KtLayer:
        """Constructs FORMATS[fmt] from config and runs its load_weights_task."""
        p2l = torch.arange(E, dtype=torch.int64)  # physical -> logical expert: identity
        log: list[str] = []
        try:
            with c_stdout_captured() as log:
                moe = getattr(self.ext.moe, FORMATS[fmt])(config)
                self.cpu.submit(moe.load_weights_task(p2l.data_ptr()))
                self.cpu.sync()
        except Exception as e:
            said = " | ".join("".join(log).strip().splitlines()[-4:])
            raise RuntimeError(
                f"kt-kernel {fmt} layer build failed: {e} (it printed: {said})"
            ) from e
        return KtLayer(fmt, moe, config, (*keep, p2l))

    def build_layer(
        self,
        fmt: str,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        layer_idx: int,
        max_tokens: int,
    ) -> KtLayer:
        """A layer of bf16 gate, up [E, I, H] and down [E, H, I], quantized into fmt: by kt-kernel's
        online loader (int8, int4) or by quantize_rawint4 (int4g32).

        top_k and max_tokens size its buffers: a forward must not pass more of either.
        """
        E, I, H = gate.shape  # noqa: E741
        for t in (gate, up, down):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("gate, up, down must be contiguous bf16")
        if fmt in RAWINT4:
            src = quantize_experts(gate, up, down)
            return self.build_rawint4_layer(fmt, src, E, top_k, layer_idx, max_tokens)
        config, keep = self._config(E, top_k, H, I, layer_idx, max_tokens)
        config.gate_proj = gate.data_ptr()
        config.up_proj = up.data_ptr()
        config.down_proj = down.data_ptr()
        return self._load(fmt, config, E, keep)

    def build_rawint4_layer(
        self,
        fmt: str,
        src: RawInt4Experts,
        num_experts: int,
        top_k: int,
        layer_idx: int,
        max_tokens: int,
    ) -> KtLayer:
        """A layer of num_experts experts from pre-quantized RAWINT4 ones (expert e = src expert
        e % src.num_experts), given per expert by pointer as kt-kernel's NativeMoEWrapper does:
        its loader copies every expert into its own buffers, so src may be freed afterwards.
        """
        _, I, half_h = src.gate[0].shape  # noqa: E741
        H = 2 * half_h  # noqa: N806
        config, keep = self._config(num_experts, top_k, H, I, layer_idx, max_tokens)

        def per_expert(t: torch.Tensor) -> list[list[int]]:  # [numa][expert] -> pointer
            return [[t[e % src.num_experts].data_ptr() for e in range(num_experts)]]

        config.gate_projs = per_expert(src.gate[0])
        config.up_projs = per_expert(src.up[0])
        config.down_projs = per_expert(src.down[0])
        config.gate_scales = per_expert(src.gate[1])
        config.up_scales = per_expert(src.up[1])
        config.down_scales = per_expert(src.down[1])
        qc = config.quant_config  # a reference into config (pybind def_readwrite)
        qc.bits = 4
        qc.group_size = RAWINT4_GROUP
        qc.zero_point = False
        got = config.quant_config
        if (got.bits, got.group_size, got.zero_point) != (4, RAWINT4_GROUP, False):
            raise RuntimeError(f"MOEConfig.quant_config did not take bits 4, group {RAWINT4_GROUP}")
        return self._load(fmt, config, num_experts, (*keep, *src.tensors))

    def inputs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> KtInputs:
        T = x.shape[0]
        return KtInputs(
            torch.tensor([T], dtype=torch.int32),
            ids.to(torch.int64).contiguous(),
            weights.to(torch.float32).contiguous(),
            x.to(torch.bfloat16).contiguous(),
            torch.empty(T, x.shape[1], dtype=torch.bfloat16),
        )

    def forward(self, layer: KtLayer, inp: KtInputs) -> None:
        task = layer.moe.forward_task(
            inp.qlen.data_ptr(),
            inp.ids.shape[1],
            inp.ids.data_ptr(),
            inp.weights.data_ptr(),
            inp.x.data_ptr(),
            inp.out.data_ptr(),
            False,
        )
        self.cpu.submit(task)
        self.cpu.sync()


def build_layers(
    peer: KtPeer,
    fmt: str,
    seeds: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_experts: int,
    top_k: int,
    want: int,
    max_tokens: int,
) -> tuple[list[KtLayer], str]:
    """Up to `want` layers whose experts repeat the seed experts; (layers, note on a shortfall).

    int8/int4: kt-kernel's loader copies the bf16 source (all experts) once more while it
    quantizes, so a layer needs the source, that copy and its packed bytes at once. int4g32: the
    seed experts are quantized once here, and its loader copies all experts' RAWINT4 bytes into a
    staging buffer before its own. Fewer layers are built when memory runs out.
    """
    from ktserve.checkpoint.sharding import available_memory_bytes  # bench_moe_kernel's path

    g, u, d = (s.to(torch.bfloat16).contiguous() for s in seeds)
    _, I, H = g.shape  # noqa: E741
    raw: RawInt4Experts | None = None
    if fmt in RAWINT4:
        raw = quantize_experts(g, u, d)
        src_bytes = sum(t.numel() * t.element_size() for t in raw.tensors)
        transient = num_experts * rawint4_expert_nbytes(H, I)
    else:
        src_bytes = transient = 3 * num_experts * I * H * 2
    per_layer = transient + num_experts * expert_nbytes(fmt, H, I) + MEM_MARGIN
    avail, source = available_memory_bytes()
    if avail < src_bytes + per_layer:
        need = (src_bytes + per_layer) / 1e9
        return [], f"needs {need:.1f} GB to build one layer, {source}: {avail / 1e9:.1f} GB"
    src = () if raw is not None else tuple(tiled_bf16(s, num_experts) for s in (g, u, d))
    layers: list[KtLayer] = []
    note = ""
    for i in range(want):
        avail, source = available_memory_bytes()
        if i and avail < per_layer:
            note = f"memory for {i} of {want} layers ({source}: {avail / 1e9:.1f} GB)"
            break
        if raw is not None:
            layers.append(peer.build_rawint4_layer(fmt, raw, num_experts, top_k, i, max_tokens))
        else:
            layers.append(peer.build_layer(fmt, *src, top_k, i, max_tokens))
    del src, raw
    return layers, note


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _ours_error(
    fmt: str,
    weights_bf16: tuple[torch.Tensor, ...],
    inputs: tuple[torch.Tensor, ...],
    ref: torch.Tensor,
    threads: int,
) -> str:
    """Our kernel's relative error on the same layer and inputs, for scale ("" if unavailable)."""
    try:
        from expert_service.kernels import MoEKernel, pack_experts

        x, ids, w = inputs
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)
        with MoEKernel(threads) as kern:
            kern.forward(pack_experts(*weights_bf16, fmt), x, ids.to(torch.int32), w, out)
        return f"; ours {rel_err(out, ref):.4f}"
    except Exception as e:
        return f"; ours n/a ({type(e).__name__}: {e})"


def run_packer_check() -> bool:
    bad = check_rawint4_packer()
    for line in bad:
        print(f"RAWINT4 packer check: FAIL: {line}")
    if not bad:
        print(
            "RAWINT4 packer check: ok (hand-packed bytes, round trip, half-step bound, the "
            "checkpoint's int32 words as bytes)"
        )
    return not bad


def selfcheck(threads: int, formats: tuple[str, ...] = tuple(FORMATS)) -> int:
    """kt-kernel vs a torch fp32 reference on a small layer; 0 when every error is in limits."""
    from tests.support.reference_moe import reference_moe

    ok = run_packer_check()
    kt, why = load_kt_kernel()
    if kt is None:
        print(f"kt-kernel selfcheck: cannot run: {why}")
        return 2
    print(f"kt-kernel: {kt.how}")
    E, k, H, I = 8, 2, 256, 128  # noqa: E741  (multiples of its 32-row / 64-column blocks)
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(E, I, H, generator=gen) * 0.02).bfloat16()
    u = (torch.randn(E, I, H, generator=gen) * 0.02).bfloat16()
    d = (torch.randn(E, H, I, generator=gen) * 0.02).bfloat16()
    peer = KtPeer(kt, threads)
    ran = 0
    for fmt in formats:
        if kt.skip_line(fmt):
            print(kt.skip_line(fmt))
            continue
        ran += 1
        layer = peer.build_layer(fmt, g, u, d, top_k=k, layer_idx=0, max_tokens=32)
        deq = None  # int4g32: the weights its kernel reads, for a torch MoE over them
        if fmt in RAWINT4:
            deq = tuple(unpack_rawint4(*quantize_rawint4(t)) for t in (g, u, d))
        for T in (1, 4, 32):  # decode; prefill below and above its 4E/k threshold
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            w = torch.rand(T, k, generator=gen)
            w = (w / w.sum(1, keepdim=True)).float()
            x = torch.randn(T, H, generator=gen).bfloat16()
            inp = peer.inputs(x, ids, w)
            inp.out.fill_(float("nan"))
            peer.forward(layer, inp)
            ref = reference_moe(x, ids, w, g, u, d)
            err = rel_err(inp.out, ref)
            good = bool(torch.isfinite(inp.out).all()) and err < SELFCHECK_LIMIT[fmt]
            ok &= good
            ours = _ours_error(OURS[fmt], (g, u, d), (x, ids, w), ref, threads)
            if fmt != OURS[fmt]:
                ours = ours.replace("; ours ", f"; ours {OURS[fmt]} ", 1)
            if deq is not None:
                deq_err = rel_err(reference_moe(x, ids, w, *deq), ref)
                ours += f"; torch over its int4 weights {deq_err:.4f}"
            print(
                f"kt-kernel {fmt} E={E} k={k} H={H} I={I} T={T:>2}: relative error {err:.4f} "
                f"(limit {SELFCHECK_LIMIT[fmt]}{ours}) {'ok' if good else 'FAIL'}"
            )
    ok &= ran > 0
    print(f"kt-kernel selfcheck: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--selfcheck", action="store_true", help="check kt-kernel against torch")
    p.add_argument("--check-packer", action="store_true", help="check the RAWINT4 packer only")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--formats", default=",".join(FORMATS), help="peer formats to self-check")
    a = p.parse_args()
    formats = tuple(f for f in a.formats.split(",") if f)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown formats {unknown}; known: {list(FORMATS)}")
    if a.check_packer:
        sys.exit(0 if run_packer_check() else 1)
    if not a.selfcheck:
        kt, why = load_kt_kernel()
        print(
            f"kt-kernel: {kt.how}; formats {list(kt.formats)}"
            if kt
            else f"kt-kernel: not usable here: {why}"
        )
        return
    sys.exit(selfcheck(a.threads, formats))


if __name__ == "__main__":
    # NOTE: run by path, bench/peers/ comes first on sys.path and this file would stand in for the
    # kt_kernel package it loads: the repo root (this tree's packages and tests) takes its place.
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    main()
