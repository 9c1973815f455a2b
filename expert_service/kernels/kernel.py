"""MoEKernel: the fused routed-experts forward on the CPU, with a persistent thread pool.

Activation precision follows the dtype of x (the output dtype, f32 or bf16, is independent):

- bf16 weights, x float32: the exact mode. x and the intermediate h = silu(gate x) * (up x) stay
  fp32; the bf16 weights are widened to fp32 (exactly) and multiplied with fp32 FMA, accumulated
  in fp32, on every ISA and for every T (AMX machines run the AVX-512 fp32 code: AMX-BF16 has no
  fp32 activations). The result is fp32 math with the bf16 weights up to the summation order
  (~1e-7 relative); this is what a parity check against an fp32 forward pass needs.
- bf16 weights, x bfloat16 (numpy uint16 or torch.bfloat16): x and h in bf16 (vdpbf16ps,
  AMX-BF16 for prefill), rounded where the exact mode is not. Faster than the exact mode where
  compute-bound (prefill), decode is memory-bound in both (the errors and rates measured:
  expert_service/kernels/README.md).
- int8 / int4 weights: x and h quantized to int8 per token (symmetric), whatever x's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from expert_service.kernels import _ext
from expert_service.kernels.arrays import DT_BF16, DT_F32, raw
from expert_service.kernels.isa import ISA_CODES, check_isa, default_isa
from expert_service.kernels.packing import FORMAT_CODES, PackedExperts

_ACT_DTYPES = {"f32": DT_F32, "bf16": DT_BF16}
# A forward call's phase marks, per pool thread, in order (ktk.h: ktk_last_marks).
MARKS = (
    "started",  # the thread began its part
    "prepared",  # the activations were quantized (every thread: after a barrier)
    "gathered",  # ... and gathered by expert (likewise)
    "gate_up_done",  # the thread took no more gate/up work
    "down_started",  # many tokens: the intermediate prepared (after a barrier); few: as the last
    "down_done",  # the thread took no more down work
    "ended",  # its part ended (few tokens: after its columns of the output were summed)
)
assert len(MARKS) == _ext.MARKS, "ktk.h's marks and these agree"


class MoEKernel:
    """Computes out[t] = sum_j w[t,j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t,j].

    num_threads counts the calling thread: it runs as worker 0 and num_threads - 1 pool threads
    are created once. Pool threads spin for KTSERVE_KERNEL_SPIN_US (default 200) microseconds
    after a call, then sleep on a futex. pin=True pins pool thread i to the i-th allowed CPU.
    Leave the feeding threads a core: a spinning pool given every core fights them for it.
    One forward call at a time per kernel (not thread-safe). ext: the extension module whose
    kernel runs (default this package's; a benchmark passes another tree's build of it, which
    reads the same packed layout: bench/baseline_kernel.py).
    """

    def __init__(
        self, num_threads: int, isa: str | None = None, *, pin: bool = False, ext: Any = None
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.isa = check_isa(isa) if isa is not None else default_isa()
        self.num_threads = num_threads
        self._k: _ext.Kernel | None = (ext or _ext).Kernel(num_threads, ISA_CODES[self.isa], pin)

    def close(self) -> None:
        if self._k is not None:
            self._k.close()
            self._k = None

    def __enter__(self) -> MoEKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward(
        self,
        packed: PackedExperts,
        x: Any,
        ids: Any,
        weights: Any,
        out: Any,
        expert_counts: np.ndarray | None = None,
    ) -> None:
        """x [T,H] f32/bf16, ids [T,k] int32 (-1 skips), weights [T,k] f32 -> out [T,H] f32/bf16.

        With bf16 weights, float32 x selects the exact fp32 mode, bf16 x bf16 math (see the
        module docstring). expert_counts: [E] int64, each expert's tokens in the call added.
        """
        if self._k is None:
            raise ValueError("MoEKernel is closed")
        w13, w2, s13, s2, r13, r2 = packed.pointers
        # NOTE: numpy arrays (the worker's slot views) take a path checked in C; anything else,
        # and whatever that path refuses, is checked here, then run or explained.
        if self._k.forward_arrays(
            FORMAT_CODES[packed.fmt], packed.num_experts, packed.hidden_size,
            packed.intermediate_size, w13, w2, s13, s2, r13, r2, x, ids, weights, out,
            expert_counts,
        ):  # fmt: skip
            return
        if expert_counts is not None:
            raise ValueError(
                f"expert_counts must be a C-contiguous [{packed.num_experts}] int64 numpy array "
                "(and x, ids, weights, out numpy arrays)"
            )
        H = packed.hidden_size
        rx, rids, rw, rout = raw(x, "x"), raw(ids, "ids"), raw(weights, "weights"), raw(out, "out")
        if len(rx.shape) != 2 or rx.shape[1] != H:
            raise ValueError(f"x must be [T, {H}], got {rx.shape}")
        T = rx.shape[0]
        if len(rids.shape) != 2 or rids.shape[0] != T:
            raise ValueError(f"ids must be [{T}, k], got {rids.shape}")
        k = rids.shape[1]
        if rw.shape != (T, k):
            raise ValueError(f"weights must be [{T}, {k}] like ids, got {rw.shape}")
        if rout.shape != (T, H):
            raise ValueError(f"out must be [{T}, {H}], got {rout.shape}")
        if rx.kind not in _ACT_DTYPES:
            raise ValueError(f"x must be float32 or bf16 (uint16 / torch.bfloat16), got {rx.kind}")
        if rout.kind not in _ACT_DTYPES:
            raise ValueError(
                f"out must be float32 or bf16 (uint16 / torch.bfloat16), got {rout.kind}"
            )
        if rids.kind != "i32":
            raise ValueError(f"ids must be int32, got {rids.kind}")
        if rw.kind != "f32":
            raise ValueError(f"weights must be float32, got {rw.kind}")
        # NOTE: ids outside [-1, E) are rejected in C before any memory is written.
        self._k.forward(
            FORMAT_CODES[packed.fmt], packed.num_experts, H, packed.intermediate_size,
            w13, w2, s13, s2, r13, r2, T, k, rx.ptr, _ACT_DTYPES[rx.kind], rids.ptr, rw.ptr,
            rout.ptr, _ACT_DTYPES[rout.kind],
        )  # fmt: skip

    def last_forward(self) -> tuple[int, int, int]:
        """The last forward call: CLOCK_MONOTONIC nanoseconds (time.monotonic_ns's clock) at
        the start and the end of its C part (routing, then the pool's run), and how many
        distinct experts it ran ((0, 0, 0) before one)."""
        if self._k is None:
            raise ValueError("MoEKernel is closed")
        return self._k.last_forward()

    def last_marks(self) -> np.ndarray:
        """Where each pool thread was in the last forward call: int64 [threads, len(MARKS)] of
        nanoseconds since its start (last_forward's first value), one column per phase mark
        (MARKS names them; zeros before a call)."""
        if self._k is None:
            raise ValueError("MoEKernel is closed")
        out = np.zeros((self.num_threads, len(MARKS)), dtype=np.int64)
        threads = self._k.last_marks(out.ctypes.data, out.size)
        out = out[:threads]
        start = self._k.last_forward()[0]
        return out - start if start else out

    def wake(self) -> None:
        """Wake pool threads that sleep (they spin again for their spin time): called when a
        call is known to be coming, their wake-up overlaps what precedes it."""
        if self._k is not None:
            self._k.wake()

    def stream_read(self, buf: Any) -> int:
        """Reads buf (a C-contiguous CPU array, size a multiple of 8 bytes) on the kernel's threads,
        each a contiguous slice, as a forward call streams weights; returns the xor of its 64-bit
        words. Timing it gives the read bandwidth these threads get (bench/bench_moe_kernel.py)."""
        if self._k is None:
            raise ValueError("MoEKernel is closed")
        rb = raw(buf, "buf")
        nbytes = int(rb.owner.nbytes)
        if nbytes % 8:
            raise ValueError(f"buf must hold a multiple of 8 bytes, got {nbytes}")
        return self._k.stream_read(rb.ptr, nbytes)
