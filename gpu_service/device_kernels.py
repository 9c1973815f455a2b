"""The device calls' hand-off as two Triton kernels per call (`--device-handoff kernels`).

`CudaStream` (device_calls.py) makes each call with five driver operations on the stream: a
pack into the staging buffer, a copy into the worker's mapped slot, a bell write, a bell wait
and a copy back. Here the GPU's own threads read and write the mapped slot (zero-copy over PCIe):

    post:    every program stores its tile of x (cast to the wire dtype), ids and weights
             straight into the request region; the last program to finish (a device counter,
             system-scope acquire/release) fences and stores request_bell = POSTED
    collect: every program spins on reply_bell == 1 (volatile loads over PCIe), fences, adds its
             tile of the reply into `out` (float32, on the device); the last program stores
             reply_bell = 0, then request_bell = IDLE

ORDERING: the bell store follows a `fence.sc.sys` after every program's stores were released
to the counter, so a worker that sees POSTED sees the whole request (x86 reads are ordered).
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


@triton.jit
def _store_one_sys(address):
    tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tst.volatile.global.u32 [$1], 1;\n\tmov.u32 $0, 0;", "=r,l",
        [address], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _store_zero_sys(address):
    tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tst.volatile.global.u32 [$1], 0;\n\tmov.u32 $0, 0;", "=r,l",
        [address], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _load_u32_volatile(address):
    return tl.inline_asm_elementwise(
        "ld.volatile.global.u32 $0, [$1];", "=r,l", [address], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _fence_sys(address):
    tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit(do_not_specialize=("num_x", "num_routes"))  # NOTE: per batch: see attention_triton
def _post_kernel(x_ptr, ids_ptr, weights_ptr, x_dst, ids_dst, weights_dst, counter_ptr,
                 bell_address, num_x, num_routes, BLOCK: tl.constexpr,
                 ROUTES: tl.constexpr):  # fmt: skip
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


@triton.jit(do_not_specialize=("num_out",))
def _collect_kernel(reply_ptr, out_ptr, counter_ptr, reply_bell_address, request_bell_address,
                    num_out, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    bell = _load_u32_volatile(reply_bell_address)
    while bell != 1:
        bell = _load_u32_volatile(reply_bell_address)
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


class KernelHandoff:
    """Posts and collects calls with the two kernels (module docstring). Addresses are device
    pointers of the mapped channels (with UVA usually the host ones); `counter` is one int32 of
    device memory per launch site, zero between launches (each kernel's last program resets it)."""

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype

    def post(self, request: int, offsets: list[int], bell: int, counter: torch.Tensor,
             x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:  # fmt: skip
        """x [rows_pad, H], ids/weights [rows_pad, k] (contiguous) -> the request region."""
        num_x, num_routes = x.numel(), ids.numel()
        _post_kernel[(triton.cdiv(num_x, BLOCK),)](
            x, ids, weights,
            MappedArray(request + offsets[0], self.wire_dtype),
            MappedArray(request + offsets[1], torch.int32),
            MappedArray(request + offsets[2], torch.float32),
            counter, bell, num_x, num_routes,
            BLOCK=BLOCK, ROUTES=triton.next_power_of_2(num_routes),
        )  # fmt: skip

    def collect(self, reply: int, reply_bell: int, request_bell: int, counter: torch.Tensor,
                out: torch.Tensor, accumulate: bool) -> None:  # fmt: skip
        """Wait for the reply and store (accumulate: add) it into out [rows_pad, H] float32."""
        num_out = out.numel()
        _collect_kernel[(triton.cdiv(num_out, BLOCK),)](
            MappedArray(reply, torch.float32), out, counter, reply_bell, request_bell, num_out,
            BLOCK=BLOCK, ACCUMULATE=accumulate,
        )  # fmt: skip
