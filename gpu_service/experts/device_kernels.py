"""The device calls' hand-off as two Triton kernels per call (`KTSERVE_DEVICE_HANDOFF=kernels`).

`CudaStream` (device_calls.py) makes each call with five driver operations on the stream: a
pack into the staging buffer, a copy into the worker's mapped slot, a bell write, a bell wait
and a copy back. Here the GPU's own threads read and write the mapped slot (zero-copy over PCIe):

    post:    every program stores its tile of x (cast to the wire dtype), ids and weights
             straight into the request region; the last program to finish (a device counter,
             system-scope acquire/release) fences and stores request_bell = POSTED
    collect: every program spins on reply_bell == 1 (volatile loads over PCIe), fences, adds its
             tile of the reply into `out` (float32, on the device); the last program stores
             reply_bell = 0, then request_bell = IDLE

STAMPS (a benchmark's option, `handoff_stamps`): each launch's last program also reads the GPU's
%globaltimer into its slot's row of int64 stamps [post time, sum of waits, waits, collect end,
sum of middles, middles]: post stores its bell's time and adds the time since the previous
slot's collect ended (the GPU's part between two MoE layers); collect adds the time from that
bell to the reply it saw (the worker's call plus both bells' latencies). Each span is on the
GPU's clock alone; bench_e2e sets them beside the worker's own times and checks the two clocks'
rates against each other (`read_globaltimer`).

ORDERING: the bell store follows a `fence.sc.sys` after every program's stores were released
to the counter, so a worker that sees POSTED sees the whole request (x86 reads are ordered).
Each bell takes exactly one store per call, by thread 0 of the last program (_store_one_sys).
Bell words live in host memory: the kernels never apply atomics to them (PCIe need not support
those), only volatile loads and stores; the counters are device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements of x (or of the reply) per program


class MappedArray:
    """A typed device pointer into mapped host memory, as Triton takes a pointer argument."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


# NOTE: Triton runs inline asm in every thread of a program, even on a scalar; a bell takes
# exactly one store per call (a second, late POSTED store re-posts a call the worker already
# claimed: it runs it twice, and its second reply_bell = 1 answers the slot's next call early,
# with this call's reply). So only thread 0 of the program stores, after its fence.
@triton.jit
def _store_one_sys(address):
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 tid;\n\tmov.u32 tid, %tid.x;\n\t"
        "setp.eq.u32 first, tid, 0;\n\tfence.sc.sys;\n\t"
        "@first st.volatile.global.u32 [$1], 1;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l", [address], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _store_zero_sys(address):
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 tid;\n\tmov.u32 tid, %tid.x;\n\t"
        "setp.eq.u32 first, tid, 0;\n\tfence.sc.sys;\n\t"
        "@first st.volatile.global.u32 [$1], 0;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l", [address], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _load_u32_volatile(address):
    return tl.inline_asm_elementwise(
        "ld.volatile.global.u32 $0, [$1];", "=r,l", [address], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _globaltimer(address):  # NOTE: the address only gives the op its (scalar) shape
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,l", [address], dtype=tl.int64, is_pure=False, pack=1,
    )  # fmt: skip


# the columns of a slot's stamps row (STAMPS above), and the same as the kernels' constants
POST_AT, WAIT_SUM, WAITS, COLLECT_END, MIDDLE_SUM, MIDDLES = range(6)
_POST_AT, _WAIT_SUM, _WAITS, _COLLECT_END, _MIDDLE_SUM, _MIDDLES = map(
    tl.constexpr, (POST_AT, WAIT_SUM, WAITS, COLLECT_END, MIDDLE_SUM, MIDDLES)
)


@triton.jit
def _fence_sys(address):
    tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=("num_x", "num_routes"))  # NOTE: per batch: see attention_triton
def _post_kernel(x_ptr, ids_ptr, weights_ptr, x_dst, ids_dst, weights_dst, counter_ptr,
                 bell_address, stamps_ptr, prev_stamps_ptr, num_x, num_routes,
                 BLOCK: tl.constexpr, ROUTES: tl.constexpr, STAMPS: tl.constexpr,
                 HAS_PREV: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_x
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_dst + offs, x.to(x_dst.dtype.element_ty), mask=mask)
    if pid == 0:
        r = tl.arange(0, ROUTES)
        rmask = r < num_routes
        ids = tl.load(ids_ptr + r, mask=rmask)
        tl.store(ids_dst + r, ids.to(tl.int32), mask=rmask)
        w = tl.load(weights_ptr + r, mask=rmask)
        tl.store(weights_dst + r, w.to(tl.float32), mask=rmask)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        _store_one_sys(bell_address)  # POSTED
        if STAMPS:
            now = _globaltimer(stamps_ptr)
            tl.store(stamps_ptr + _POST_AT, now)
            if HAS_PREV:
                since = now - tl.load(prev_stamps_ptr + _COLLECT_END)
                tl.store(stamps_ptr + _MIDDLE_SUM, tl.load(stamps_ptr + _MIDDLE_SUM) + since)
                tl.store(stamps_ptr + _MIDDLES, tl.load(stamps_ptr + _MIDDLES) + 1)


@triton.jit(do_not_specialize=("num_out",))
def _collect_kernel(reply_ptr, out_ptr, counter_ptr, reply_bell_address, request_bell_address,
                    stamps_ptr, num_out, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
                    STAMPS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    bell = _load_u32_volatile(reply_bell_address)
    while bell != 1:
        bell = _load_u32_volatile(reply_bell_address)
    if STAMPS:
        seen = _globaltimer(stamps_ptr)
    _fence_sys(reply_bell_address)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_out
    reply = tl.load(reply_ptr + offs, mask=mask, volatile=True)
    if ACCUMULATE:
        reply += tl.load(out_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, reply, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        _store_zero_sys(reply_bell_address)
        _store_zero_sys(request_bell_address)  # IDLE
        if STAMPS:
            waited = seen - tl.load(stamps_ptr + _POST_AT)
            tl.store(stamps_ptr + _WAIT_SUM, tl.load(stamps_ptr + _WAIT_SUM) + waited)
            tl.store(stamps_ptr + _WAITS, tl.load(stamps_ptr + _WAITS) + 1)
            tl.store(stamps_ptr + _COLLECT_END, _globaltimer(stamps_ptr))


@triton.jit
def _read_globaltimer_kernel(out_ptr):
    tl.store(out_ptr, _globaltimer(out_ptr))


def read_globaltimer(device: torch.device) -> int:
    """The GPU's %globaltimer now (ns; a benchmark sets the stamps' clock against the host's)."""
    out = torch.zeros(1, dtype=torch.int64, device=device)
    _read_globaltimer_kernel[(1,)](out)
    return int(out.item())


class KernelHandoff:
    """Posts and collects calls with the two kernels (module docstring). Addresses are device
    pointers of the mapped channels (with UVA usually the host ones); `counter` is one int32 of
    device memory per launch site, zero between launches (each kernel's last program resets it)."""

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype

    def post(self, request: int, offsets: list[int], bell: int, counter: torch.Tensor,
             x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             stamps: torch.Tensor | None = None,
             prev_stamps: torch.Tensor | None = None) -> None:  # fmt: skip
        """x [rows_pad, H], ids/weights [rows_pad, k] (contiguous) -> the request region.
        stamps: this slot's int64 row (module docstring), prev_stamps the previous slot's."""
        num_x, num_routes = x.numel(), ids.numel()
        _post_kernel[(triton.cdiv(num_x, BLOCK),)](
            x, ids, weights,
            MappedArray(request + offsets[0], self.wire_dtype),
            MappedArray(request + offsets[1], torch.int32),
            MappedArray(request + offsets[2], torch.float32),
            counter, bell, _or_counter(stamps, counter), _or_counter(prev_stamps, counter),
            num_x, num_routes,
            BLOCK=BLOCK, ROUTES=triton.next_power_of_2(num_routes), STAMPS=stamps is not None,
            HAS_PREV=prev_stamps is not None,
        )  # fmt: skip

    def collect(self, reply: int, reply_bell: int, request_bell: int, counter: torch.Tensor,
                out: torch.Tensor, accumulate: bool,
                stamps: torch.Tensor | None = None) -> None:  # fmt: skip
        """Wait for the reply and store (accumulate: add) it into out [rows_pad, H] float32."""
        num_out = out.numel()
        _collect_kernel[(triton.cdiv(num_out, BLOCK),)](
            MappedArray(reply, torch.float32), out, counter, reply_bell, request_bell,
            _or_counter(stamps, counter), num_out,
            BLOCK=BLOCK, ACCUMULATE=accumulate, STAMPS=stamps is not None,
        )  # fmt: skip


def _or_counter(stamps: torch.Tensor | None, counter: torch.Tensor) -> torch.Tensor:
    """The stamps row, or (where STAMPS is off and the kernel never reads it) any device
    pointer: the counter."""
    if stamps is None:
        return counter
    if stamps.dtype != torch.int64 or stamps.numel() < MIDDLES + 1 or not stamps.is_contiguous():
        raise ValueError("a slot's stamps must be a contiguous int64 row of 6")
    return stamps
