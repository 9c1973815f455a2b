"""`ktserve expert` (run a CPU expert worker) and `ktserve convert` (pack a shard to disk)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from expert_service.config import WorkerConfig, default_num_threads
from ktserve.names import WEIGHT_FORMATS

log = logging.getLogger("ktserve.expert")


def add_expert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "expert",
        help="run a CPU expert worker",
        description=(
            "Run a CPU expert worker: it holds a shard of a model's routed experts in RAM and "
            "answers MoE calls from the GPU service over shared memory (ktshm). Control (load, "
            "attach a channel, stats, drain) is gRPC on --listen; metrics are Prometheus on "
            "--metrics-port. SIGTERM answers the calls in flight, then exits."
        ),
    )
    p.add_argument("--model", help="checkpoint directory (Hugging Face: config.json + "
                   "*.safetensors) or a `ktserve convert` output, loaded at start; without it the "
                   "worker waits for a LoadModel call")  # fmt: skip
    p.add_argument("--listen", default=WorkerConfig.listen,
                   help="gRPC address: HOST:PORT (port 0 picks a free one) or unix:/path.sock "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--experts", help="expert ids this worker holds, inclusive, e.g. 0-63 "
                   "(default: all)")  # fmt: skip
    p.add_argument("--format", dest="weight_format", choices=WEIGHT_FORMATS,
                   default=WorkerConfig.weight_format,
                   help="weight format in RAM: bf16 (exact), int8 (per-row scales), int4 "
                   "(group-32 scales) (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--threads", type=int, help=f"kernel threads (default: cores - 1 = {default_num_threads()})"
    )
    p.add_argument(
        "--isa",
        choices=("avx2", "avx512", "amx"),
        help="force the kernel's instruction set (default: the best this CPU has)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port (default: off)",
    )
    p.add_argument(
        "--metrics-host",
        default=WorkerConfig.metrics_host,
        help="address of the metrics endpoint (default %(default)s)",
    )
    p.add_argument("--spin-us", type=float, default=WorkerConfig.spin_us,
                   help="how long a channel thread spins for work before it sleeps, in "
                   "microseconds (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        default=WorkerConfig.drain_timeout_s,
        help="seconds SIGTERM waits for calls in flight (default %(default)s)",
    )
    p.set_defaults(run=run_expert)


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="quantize and pack a shard of routed experts to disk",
        description=(
            "Read a checkpoint's routed experts, quantize and pack them for the CPU kernel, and "
            "write them to --out, so that `ktserve expert --model OUT` maps them back in seconds."
        ),
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--experts", help="expert ids, inclusive, e.g. 0-63 (default: all)")
    p.add_argument(
        "--format",
        dest="weight_format",
        choices=WEIGHT_FORMATS,
        default="int8",
        help="weight format (default %(default)s)",
    )
    p.add_argument("--threads", type=int, help="packing threads (default: all cores)")
    p.set_defaults(run=run_convert)


def run_expert(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from expert_service.server import build_server, set_serving
    from expert_service.shard import ProgressPrinter
    from expert_service.worker import ExpertWorker

    config = WorkerConfig(
        model=args.model, listen=args.listen, experts=args.experts,
        weight_format=args.weight_format, threads=args.threads, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, spin_us=args.spin_us,
        drain_timeout_s=args.drain_timeout_s, isa=args.isa,
    )  # fmt: skip
    worker = ExpertWorker(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, port, health = build_server(worker, config.listen)
    address = (
        config.listen
        if config.listen.startswith("unix:")
        else (f"{config.listen.rsplit(':', 1)[0]}:{port}")
    )
    if config.metrics_port:
        start_http_server(
            config.metrics_port, config.metrics_host, registry=worker.metrics.registry
        )
    print(f"ktserve expert: listening on {address} (isa {worker.kernel.isa}, "
          f"{worker.kernel.num_threads} threads, pid {worker.pid})", flush=True)  # fmt: skip
    try:
        if config.model:
            worker.load(config.model, config.expert_range, config.weight_format,
                        progress=ProgressPrinter(sys.stderr, "loading experts"))  # fmt: skip
            set_serving(health, True)
            print(f"ktserve expert: serving {worker._describe()}", flush=True)
        while not (stop.is_set() or worker.exit_requested.is_set()):
            stop.wait(0.5)
        print("ktserve expert: draining", flush=True)
        set_serving(health, False)
        completed = worker.drain()
        print(f"ktserve expert: drained after {completed} calls; exiting", flush=True)
        return 0
    finally:
        server.stop(grace=1).wait()
        worker.close()


def run_convert(args: argparse.Namespace) -> int:
    import json

    from expert_service import packed_store
    from expert_service.shard import ProgressPrinter, load_shard
    from ktserve.checkpoint import parse_expert_range

    experts = parse_expert_range(args.experts) if args.experts else None
    shard = load_shard(args.model, experts, args.weight_format, pack_threads=args.threads,
                       progress=ProgressPrinter(sys.stderr, "packing experts"))  # fmt: skip
    config = json.loads((Path(args.model) / "config.json").read_text())
    out = packed_store.save(shard, args.out, config)
    print(f"ktserve convert: wrote {shard.nbytes / 2**30:.2f} GiB ({len(shard.layers)} layers, "
          f"experts {shard.experts.start}-{shard.experts.stop - 1}, {shard.weight_format}) "
          f"to {out}")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ktserve",
        description="Serve huge Mixture-of-Experts models on one GPU plus host RAM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_expert_parser(sub)
    add_convert_parser(sub)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse argv and run the chosen subcommand; a user's mistake is one line and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parser.parse_args(argv)
    from ktserve.checkpoint import CheckpointError

    try:
        return args.run(args)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"ktserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
