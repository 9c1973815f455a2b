"""Probe of the device hand-off's memory ordering (`KTSERVE_DEVICE_HANDOFF=kernels`) on a GPU host.

One device channel, registered and mapped as the server maps it, served by a consumer process
that checks every request it takes and answers with a known reply. Each call's request is a
tag (x, ids and weights all equal to it); the consumer counts requests that are not all one
tag (torn: it read part of an older request) and tags it takes twice (a call run again), and
answers with tag + 0.5 everywhere; the GPU counts replies that are not (stale: it took an older
reply). Variants of the two Triton kernels run side by side, eagerly and as one graph a step:

    every thread        the bells as stored before 2026-12-07: every thread of the last program
                        fences and stores (a late POSTED re-posts a call the consumer claimed)
    one thread          thread 0 alone stores each bell (device_kernels.py)
    one thread+fences   and every thread fences its own request stores before the barrier

`--worker` instead runs DeviceCalls (the kernels as shipped, and memops) against a real expert
worker on tiny checkpoints, each call's sum against the same call over the worker's ordinary
channel.

    usage: python tools/probe_handoff.py [--steps N] [--slots L] [--rows R] [--hidden H]
           [--delay-us D]   (the consumer's random delay before it replies, 0..D)
           python tools/probe_handoff.py --worker
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages and tests

from gpu_service.experts import device_kernels as dk  # noqa: E402


@triton.jit
def fence_sc_sys(address):
    tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def store_sys_every_thread(address, VALUE: tl.constexpr):
    """The bell store before the fix: every thread of the program fences and stores."""
    tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tst.volatile.global.u32 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [address, tl.full((), VALUE, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def store_sys(address, VALUE: tl.constexpr, ONE_THREAD: tl.constexpr):
    if ONE_THREAD:
        if VALUE == 1:
            dk._store_one_sys(address)
        else:
            dk._store_zero_sys(address)
    else:
        store_sys_every_thread(address, VALUE)


@triton.jit(do_not_specialize=("num_x", "num_routes"))
def post_kernel(x_ptr, ids_ptr, weights_ptr, x_dst, ids_dst, weights_dst, counter_ptr,
                bell_address, num_x, num_routes, BLOCK: tl.constexpr, ROUTES: tl.constexpr,
                ONE_THREAD: tl.constexpr, FENCE_EACH: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_x
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_dst + offs, x.to(x_dst.dtype.element_ty), mask=mask)
    if pid == 0:
        r = tl.arange(0, ROUTES)
        rmask = r < num_routes
        tl.store(ids_dst + r, tl.load(ids_ptr + r, mask=rmask).to(tl.int32), mask=rmask)
        tl.store(weights_dst + r, tl.load(weights_ptr + r, mask=rmask).to(tl.float32),
                 mask=rmask)  # fmt: skip
    if FENCE_EACH:
        fence_sc_sys(bell_address)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        store_sys(bell_address, 1, ONE_THREAD)


@triton.jit(do_not_specialize=("num_out",))
def collect_kernel(reply_ptr, out_ptr, counter_ptr, reply_bell_address,
                   request_bell_address, num_out, BLOCK: tl.constexpr,
                   ONE_THREAD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    bell = dk._load_u32_volatile(reply_bell_address)
    while bell != 1:
        bell = dk._load_u32_volatile(reply_bell_address)
    dk._fence_sys(reply_bell_address)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_out
    reply = tl.load(reply_ptr + offs, mask=mask, volatile=True)
    tl.store(out_ptr + offs, reply, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        tl.store(counter_ptr, 0)
        store_sys(reply_bell_address, 0, ONE_THREAD)
        store_sys(request_bell_address, 0, ONE_THREAD)


REPORT, STOP = -2, -1  # tags of the requests that ask the consumer for its counts, or end it


def consumer(name: str, delay_us: float, seed: int) -> None:
    """Serves the probe's channel: counts torn requests (not all one tag) and duplicates (a tag
    taken twice: a call run again), answers each with tag + 0.5, a REPORT with its counts."""
    import ktshm

    rng = random.Random(seed)
    ch = ktshm.Channel.attach(name)
    seen: set[int] = set()
    torn = duplicates = calls = 0
    while True:
        msg = ch.recv_request(timeout=60)
        x, ids, w = msg.arrays
        rows, hidden = x.shape
        tag = int(ids.flat[0])
        if tag == STOP:
            ch.reply(msg, [np.zeros((rows, hidden), np.float32)])
            return
        if tag == REPORT:
            counts = np.zeros((rows, hidden), np.float32)
            counts.flat[:3] = (torn, duplicates, calls)
            torn = duplicates = calls = 0
            ch.reply(msg, [counts])
            continue
        calls += 1
        duplicates += tag in seen
        seen.add(tag)
        bad = int((x != np.float32(tag)).sum() + (ids != tag).sum() + (w != np.float32(tag)).sum())
        torn += bad > 0
        if delay_us:
            until = time.perf_counter() + rng.uniform(0, delay_us) * 1e-6
            while time.perf_counter() < until:
                pass
        ch.reply(msg, [np.full((rows, hidden), tag + 0.5, np.float32)])


# name: (the bell stored by thread 0 alone, every thread fences its own stores)
# NOTE: "every thread" last: a call it re-posts can still be answered after its last step, and
# that late reply_bell = 1 would answer a later variant's call early
VARIANTS = {
    "one thread": (True, False),
    "one thread+fences": (True, True),
    "every thread": (False, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--delay-us", type=float, default=0.0)
    args = p.parse_args()

    import torch

    import ktshm
    from gpu_service.experts.device_calls import CudaStream, region_bytes
    from ktserve import wire

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}; {args.slots} slots, {args.rows} rows x {args.hidden} float32, consumer "
          f"delay 0..{args.delay_us:.0f} us; {torch.cuda.get_device_name()}")  # fmt: skip
    device = torch.device("cuda")
    rows, hidden, k, slots = args.rows, args.hidden, 1, args.slots
    config = ktshm.ChannelConfig(num_slots=slots, region_bytes=region_bytes(rows, hidden, 8),
                                 spin_us=1e6, default_timeout_s=30)  # fmt: skip
    ch = ktshm.Channel.create(config, device=True)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(ch.address, ch.size, 3)) != 0:  # portable | mapped
        raise RuntimeError("cudaHostRegister failed")
    proc = subprocess.Popen([sys.executable, __file__, "--consumer", ch.name,
                             str(args.delay_us), str(seed)])  # fmt: skip
    ch.wait_for_peer(60)
    specs = [((rows, hidden), "float32"), ((rows, k), wire.IDS_DTYPE),
             ((rows, k), wire.WEIGHTS_DTYPE)]  # fmt: skip
    for j in range(slots):
        offsets = ch.device_layout(j, wire.KIND_MOE, j, specs)
    stream = CudaStream([ch])
    addr = [tuple(stream.device_address(ch, a) for a in ch.device_slot(j)) for j in range(slots)]
    counters = torch.zeros((slots, 2), dtype=torch.int32, device=device)
    tags = torch.zeros(slots, dtype=torch.float32, device=device)
    xs = torch.zeros((slots, rows, hidden), device=device)
    ids = torch.zeros((slots, rows, k), dtype=torch.int32, device=device)
    ws = torch.zeros((slots, rows, k), device=device)
    outs = torch.zeros((slots, rows, hidden), device=device)
    grid = (triton.cdiv(rows * hidden, dk.BLOCK),)

    def call(j: int, one_thread: bool, fence_each: bool) -> None:
        req_bell, rep_bell, request, reply = addr[j]
        post_kernel[grid](
            xs[j], ids[j], ws[j], dk.MappedArray(request + offsets[0], torch.float32),
            dk.MappedArray(request + offsets[1], torch.int32),
            dk.MappedArray(request + offsets[2], torch.float32), counters[j, 0], req_bell,
            rows * hidden, rows * k, BLOCK=dk.BLOCK, ROUTES=triton.next_power_of_2(rows * k),
            ONE_THREAD=one_thread, FENCE_EACH=fence_each,
        )  # fmt: skip
        collect_kernel[grid](
            dk.MappedArray(reply, torch.float32), outs[j], counters[j, 1], rep_bell, req_bell,
            rows * hidden, BLOCK=dk.BLOCK, ONE_THREAD=one_thread,
        )  # fmt: skip

    def step(one_thread: bool, fence_each: bool) -> None:
        for j in range(slots):
            xs[j].copy_(tags[j].expand(rows, hidden))
            ids[j].copy_(tags[j].expand(rows, k))
            ws[j].copy_(tags[j].expand(rows, k))
            call(j, one_thread, fence_each)
        stream.end(ch)

    def see_through() -> None:
        failed = ktshm.wait_device_step([ch], 30)
        if failed is not None:  # the GPU spins on a bell nobody will ring: nothing ends it
            print(f"the consumer failed a call: {failed}", flush=True)
            os._exit(1)
        torch.cuda.synchronize()

    def control(tag: int) -> list[float]:
        """One call of tag REPORT or STOP on slot 0 (the safe kernels); the reply's first 3."""
        tags[0] = tag
        ch.begin_step()
        xs[0].fill_(tag)
        ids[0].fill_(tag)
        ws[0].fill_(tag)
        call(0, True, True)
        stream.end(ch)
        see_through()
        return outs[0].flatten()[:3].tolist()

    print(f"{'bell store':>18} {'mode':>6} {'calls':>6} {'stale replies':>14} {'torn':>5} "
          f"{'run twice':>10} {'us a call':>10}")  # fmt: skip
    next_tag = 1
    try:
        for name, (one_thread, fence_each) in VARIANTS.items():
            for mode in ("eager", "graph"):
                graph = None
                stale = 0
                seconds = 0.0
                for _ in range(args.steps):
                    if mode == "graph" and graph is None:
                        tags.copy_(torch.arange(next_tag, next_tag + slots))
                        next_tag += slots
                        ch.begin_step()
                        step(one_thread, fence_each)
                        see_through()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step(one_thread, fence_each)
                    want = torch.arange(next_tag, next_tag + slots, dtype=torch.float32)
                    next_tag += slots
                    tags.copy_(want)
                    torch.cuda.synchronize()
                    ch.begin_step()
                    start = time.perf_counter()
                    if graph is not None:
                        graph.replay()
                    else:
                        step(one_thread, fence_each)
                    see_through()
                    seconds += time.perf_counter() - start
                    bad = (outs.cpu() != (want + 0.5).view(slots, 1, 1)).sum(dim=(1, 2))
                    stale += int((bad > 0).sum())
                torn, twice, seen = control(REPORT)
                print(f"{name:>18} {mode:>6} {int(seen):>6} {stale:>14} {int(torn):>5} "
                      f"{int(twice):>10} {seconds / args.steps / slots * 1e6:>10.1f}")  # fmt: skip
        control(STOP)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        cudart.cudaHostUnregister(ch.address)
        ch.close()


def with_worker(steps: int, rows: int, rows_pad: int, handoff: str, family: str) -> None:
    """DeviceCalls against a real worker on a tiny checkpoint: each call's routed sum, eager and
    in a captured graph, against the same call through the worker's ordinary channel."""
    import tempfile

    import torch

    from gpu_service.config import ExpertClientConfig
    from gpu_service.experts.moe_client import ShmExperts
    from ktserve.checkpoint import CheckpointReader
    from tests.support.checkpoints import make_tiny_checkpoint
    from tests.support.expert_procs import ExpertProcess

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(family, tmp, seed=seed)
        spec = CheckpointReader(path).spec
        worker = ExpertProcess("--model", str(path), "--format", "bf16")
        experts = ShmExperts(
            ExpertClientConfig((worker.address,), token=worker.token, wire_dtype="float32",
                               worker_timeout_s=20, device_handoff=handoff),
            hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=64,
            device="cuda",
        )  # fmt: skip
        try:
            layers = spec.moe_layers
            calls = experts.device_calls(layers, 16)
            calls.layout(rows_pad)
            h, k, e = spec.hidden_size, spec.num_experts_per_tok, spec.num_experts
            n = len(layers)
            xs = torch.zeros((n, rows_pad, h), device="cuda")
            ids = torch.zeros((n, rows_pad, k), dtype=torch.int64, device="cuda")
            ws = torch.zeros((n, rows_pad, k), device="cuda")
            outs = torch.zeros((n, rows_pad, h), device="cuda")

            def step():
                for j in range(n):
                    calls.call(j, xs[j], ids[j], ws[j])
                    calls.collect(j, outs[j])
                calls.end_step()

            print(f"worker mode: {family}, seed {seed}, handoff {handoff}, {n} slots, rows "
                  f"{rows} of {rows_pad}, hidden {h}")  # fmt: skip
            for mode in ("eager", "graph"):
                graph = None
                bad_calls = bad_elems = 0
                for _ in range(steps):
                    xs.copy_(torch.randn(xs.shape, generator=g))
                    ids.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in
                                           range(n * rows_pad)]).view(n, rows_pad, k))  # fmt: skip
                    ws.copy_(torch.rand(ws.shape, generator=g))
                    if mode == "graph" and graph is None:
                        calls.begin_step(rows_pad, rows_pad)
                        step()
                        calls.wait()
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                    calls.begin_step(rows_pad, rows)
                    if graph is None:
                        step()
                    else:
                        graph.replay()
                    calls.wait()
                    torch.cuda.synchronize()
                    for j, layer in enumerate(layers):
                        x, i, w = xs[j, :rows], ids[j, :rows], ws[j, :rows]
                        want = experts.submit(layer, x, i, w).wait()
                        got = outs[j, :rows]
                        diff = int((got != want.to(got.device)).sum())
                        bad_calls += diff > 0
                        bad_elems += diff
                print(f"  {mode:>6}: {steps} steps, {bad_calls} calls differ, {bad_elems} elements")
        finally:
            experts.close()
            worker.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consumer":
        consumer(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--worker":
        for family in ("qwen3_moe", "deepseek_v3"):
            for handoff in ("memops", "kernels"):
                with_worker(50, 3, 4, handoff, family)
    else:
        main()
