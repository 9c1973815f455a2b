"""kt-kernel (KTransformers' CPU MoE kernels, AMX int8/int4) as a peer for bench_moe_kernel.py.

kt-kernel is no dependency of ktserve: it is used when `kt_kernel` is importable (installed, or its
package directory on PYTHONPATH) on a CPU with AMX. A layer is built the way its online-quantizing
loader does it: raw bf16 gate/up [E, I, H] and down [E, H, I] pointers in a MOEConfig with
save=False, load=False (so nothing is written to disk), AMXInt8_MOE / AMXInt4_MOE(config), then
load_weights_task quantizes them (one scale per output row). forward_task takes qlen as a pointer
to an int32, expert ids int64 [T, k], weights f32 [T, k], x bf16 [T, H] -> out bf16 [T, H]; a task
is handed to CPUInfer.submit and waited for with CPUInfer.sync.

Threads: CPUInfer(WorkerPoolConfig) with one subpool of N threads runs N compute threads (its
NUMA-job thread as worker 0 plus N - 1 pool threads, pinned to cores 0..N-1 of NUMA node 0), plus
its task-queue thread, which busy-waits on them during a call; the caller sleeps in sync(). Ours
counts the caller as one of its N. Its pool threads spin 50 ms after a call before they sleep.

    python bench/peer_kt_kernel.py --selfcheck [--threads 4]

checks kt-kernel's forward (int8 and int4, T = 1, 4, 32: the decode, AVX-512 and AMX paths) on a
small layer against a plain torch fp32 MoE over the same bf16 weights and prints the relative
errors, with ours beside them when expert_service's kernel imports.
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
from typing import Any

import torch

FORMATS = {"int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}
SELFCHECK_LIMIT = {"int8": 0.05, "int4": 0.4}  # relative L2 error; a wrong call gives ~1
MEM_MARGIN = 4 << 30  # bytes left free when building layers


@dataclass(frozen=True)
class KtKernel:
    ext: Any  # the kt_kernel_ext extension module
    how: str  # how it was loaded


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
    missing = [n for n in FORMATS.values() if not hasattr(ext.moe, n)]
    variant = getattr(ext, "__cpu_variant__", "?")
    if missing or variant != "amx":
        return None, f"kt_kernel_ext variant {variant!r} lacks {missing or list(FORMATS.values())}"
    return KtKernel(ext, f"{how}, variant {variant}, int8 kernel {ext.__int8_kernel__}"), ""


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
    """Bytes of one expert in kt-kernel's AMX buffers: n*k (int8) or n*k/2 (int4) + f32 per row."""
    per = {"int8": 1.0, "int4": 0.5}[fmt]
    return int(3 * hidden * inter * per) + 4 * (2 * inter + hidden)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


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
        self.threads = threads
        pool = self.ext.WorkerPoolConfig()
        pool.subpool_count = 1
        pool.subpool_numa_map = [0]
        pool.subpool_thread_count = [threads]
        with c_stdout_captured():
            self.cpu = self.ext.CPUInfer(pool)

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
        """Quantizes bf16 gate, up [E, I, H] and down [E, H, I] with kt-kernel's online loader.

        top_k and max_tokens size its buffers: a forward must not pass more of either.
        """
        E, I, H = gate.shape  # noqa: E741
        for t in (gate, up, down):
            if t.dtype != torch.bfloat16 or not t.is_contiguous():
                raise ValueError("gate, up, down must be contiguous bf16")
        mask = torch.zeros(E, dtype=torch.uint8)  # no expert on a GPU
        p2l = torch.arange(E, dtype=torch.int64)  # physical -> logical expert: identity
        config = self.ext.moe.MOEConfig(E, top_k, H, I, 0)
        config.gpu_experts_mask = mask.data_ptr()
        config.layer_idx = layer_idx
        config.pool = self.cpu.backend_
        config.max_len = max_tokens
        config.save = False
        config.load = False
        config.gate_proj = gate.data_ptr()
        config.up_proj = up.data_ptr()
        config.down_proj = down.data_ptr()
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
        return KtLayer(fmt, moe, config, (mask, p2l))

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

    kt-kernel's loader copies the bf16 source once more while it quantizes, so a layer needs the
    source, that copy and its packed bytes at once; fewer layers are built when memory runs out.
    """
    g, u, d = seeds
    _, I, H = g.shape  # noqa: E741
    src_bytes = 3 * num_experts * I * H * 2
    per_layer = src_bytes + num_experts * expert_nbytes(fmt, H, I) + MEM_MARGIN
    avail = mem_available()
    if avail < src_bytes + per_layer:
        need = (src_bytes + per_layer) / 1e9
        return [], f"needs {need:.1f} GB to build one layer, MemAvailable {avail / 1e9:.1f} GB"
    src = tuple(tiled_bf16(s.to(torch.bfloat16), num_experts) for s in (g, u, d))
    layers: list[KtLayer] = []
    note = ""
    for i in range(want):
        if i and mem_available() < per_layer:
            note = f"memory for {i} of {want} layers (MemAvailable {mem_available() / 1e9:.1f} GB)"
            break
        layers.append(peer.build_layer(fmt, *src, top_k, i, max_tokens))
    del src
    return layers, note


def reference_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Plain fp32 MoE over the (bf16) weights: sum_j w[t,j] * down(silu(gate x) * up x)."""
    xf = x.float()
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(gate[e].float() @ xf[t]) * (up[e].float() @ xf[t])
            y[t] += float(weights[t, j]) * (down[e].float() @ h)
    return y


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
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if repo not in sys.path:
            sys.path.insert(0, repo)
        from expert_service.kernels import MoEKernel, pack_experts

        x, ids, w = inputs
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)
        with MoEKernel(threads) as kern:
            kern.forward(pack_experts(*weights_bf16, fmt), x, ids.to(torch.int32), w, out)
        return f"; ours {rel_err(out, ref):.4f}"
    except Exception as e:
        return f"; ours n/a ({type(e).__name__}: {e})"


def selfcheck(threads: int) -> int:
    """kt-kernel vs a torch fp32 reference on a small layer; 0 when every error is in limits."""
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
    ok = True
    for fmt in FORMATS:
        layer = peer.build_layer(fmt, g, u, d, top_k=k, layer_idx=0, max_tokens=32)
        for T in (1, 4, 32):  # decode; prefill on AVX-512 (T <= 4E/k); prefill on AMX
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
            ours = _ours_error(fmt, (g, u, d), (x, ids, w), ref, threads)
            print(
                f"kt-kernel {fmt} E={E} k={k} H={H} I={I} T={T:>2}: relative error {err:.4f} "
                f"(limit {SELFCHECK_LIMIT[fmt]}{ours}) {'ok' if good else 'FAIL'}"
            )
    print(f"kt-kernel selfcheck: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--selfcheck", action="store_true", help="check kt-kernel against torch")
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    if not a.selfcheck:
        kt, why = load_kt_kernel()
        print(f"kt-kernel: {kt.how}" if kt else f"kt-kernel: not usable here: {why}")
        return
    sys.exit(selfcheck(a.threads))


if __name__ == "__main__":
    main()
