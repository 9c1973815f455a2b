"""Round-trip latency between two processes: ktshm (spinning, blocking) vs gRPC vs Pipe.

The peer process echoes what it receives; the producer times send -> reply -> copy out.
Prints one table: p50/p99 in microseconds per payload size and transport, and the ratio of
gRPC's p50 to ktshm-spin's p50.

    python bench/bench_ktshm.py [--iters 20000] [--sizes 4096,14336,1048576]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from concurrent import futures
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's packages

import ktshm
from bench.common import Column, latency_samples_us, print_table

GRPC_METHOD = "/ktserve.bench.Echo/Echo"


# ----------------------------------------------------------------------------- peers
def ktshm_peer(name: str, spin_us: float) -> None:
    channel = ktshm.Channel.attach(name, ktshm.ChannelConfig(spin_us=spin_us))
    try:
        while True:
            try:
                req = channel.recv_request(timeout=60)
            except (ktshm.PeerDied, ktshm.ChannelTimeout):
                return
            channel.reply(req, req.arrays)
    finally:
        channel.close()


def grpc_peer(port_queue: mp.Queue, stop: mp.Event) -> None:
    import grpc

    handler = grpc.method_handlers_generic_handler(
        "ktserve.bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    stop.wait()
    server.stop(0)


def pipe_peer(conn) -> None:
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(data)


# ----------------------------------------------------------------------------- clients
def bench_ktshm(ctx, size: int, iters: int, spin_us: float) -> np.ndarray:
    config = ktshm.ChannelConfig(num_slots=4, region_bytes=max(size, 4096), spin_us=spin_us)
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    with ktshm.Channel.create(config) as channel:
        peer = ctx.Process(target=ktshm_peer, args=(channel.name, spin_us))
        peer.start()
        channel.wait_for_peer(timeout=30)

        def step():
            out = channel.call(0, 0, [payload])
            assert out[0].nbytes == size

        samples = latency_samples_us(step, iters)
    peer.join(timeout=10)
    return samples


def bench_grpc(ctx, size: int, iters: int) -> np.ndarray:
    import grpc

    port_queue, stop = ctx.Queue(), ctx.Event()
    peer = ctx.Process(target=grpc_peer, args=(port_queue, stop))
    peer.start()
    port = port_queue.get(timeout=30)
    payload = bytes(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))
    with grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    ) as chan:
        echo = chan.unary_unary(GRPC_METHOD)

        def step():
            assert len(echo(payload, timeout=10)) == size

        samples = latency_samples_us(step, iters)
    stop.set()
    peer.join(timeout=10)
    return samples


def bench_pipe(ctx, size: int, iters: int) -> np.ndarray:
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=pipe_peer, args=(child,))
    peer.start()
    payload = bytes(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))

    def step():
        parent.send_bytes(payload)
        assert len(parent.recv_bytes()) == size

    samples = latency_samples_us(step, iters)
    parent.send_bytes(b"")
    peer.join(timeout=10)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000, help="round trips per cell (<=64 KiB)")
    parser.add_argument("--sizes", default="4096,14336,1048576", help="payload bytes, comma list")
    parser.add_argument("--spin-us", type=float, default=200.0, help="spin budget of ktshm-spin")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    sizes = [int(s) for s in args.sizes.split(",")]

    rows = []
    for size in sizes:
        iters = args.iters if size <= 65536 else max(args.iters // 10, 200)
        results = {
            "ktshm spin": bench_ktshm(ctx, size, iters, args.spin_us),
            "ktshm block": bench_ktshm(ctx, size, iters, 0.0),
            "gRPC unary": bench_grpc(ctx, size, iters),
            "mp.Pipe": bench_pipe(ctx, size, iters),
        }
        spin_p50 = float(np.percentile(results["ktshm spin"], 50))
        for name, samples in results.items():
            p50, p99 = np.percentile(samples, [50, 99])
            rows.append((size, name, iters, p50, p99, p50 / spin_p50))

    print(f"round-trip latency between two processes ({mp.cpu_count()} CPUs)")
    columns = [Column("payload", 9), Column("transport", 12, "<"), Column("iters", 6),
               Column("p50 us", 9), Column("p99 us", 9),
               Column("p50 / ktshm spin", 16)]  # fmt: skip
    cells = []
    for size, name, iters, p50, p99, ratio in rows:
        label = f"{size // 1024} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
        cells.append([label, name, str(iters), f"{p50:.1f}", f"{p99:.1f}", f"{ratio:.1f}x"])
    print_table(columns, cells)


if __name__ == "__main__":
    main()
