"""`ktserve expert` (run a CPU expert worker) and `ktserve convert` (pack a shard to disk); their
flags are WorkerConfig's and ConvertConfig's fields."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from expert_service.config import ConvertConfig, WorkerConfig
from ktserve.config_flags import add_flags, from_args


def configure_expert(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a CPU expert worker: it holds a shard of a model's routed experts in RAM and "
        "answers MoE calls from the GPU service over shared memory (ktshm). Control (load, "
        "attach a channel, stats, drain) is gRPC on --listen; metrics are Prometheus on "
        "--metrics-port. SIGTERM answers the calls in flight, then exits."
    )
    add_flags(parser, WorkerConfig)
    parser.set_defaults(run=run_expert)


def configure_convert(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read a checkpoint's routed experts, quantize and pack them for the CPU kernel, and "
        "write them to --out, so that `ktserve expert --model OUT` maps them back in seconds."
    )
    add_flags(parser, ConvertConfig)
    parser.set_defaults(run=run_convert)


def run_expert(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from expert_service.placement import place_worker
    from expert_service.server import build_server, set_serving
    from expert_service.shard import ProgressPrinter
    from expert_service.worker import ExpertWorker
    from ktserve.model_label import labeled_registry
    from ktserve.numa import format_cpulist
    from ktserve.worker_token import TokenError, listener_refusal, read_token

    config = from_args(WorkerConfig, args)
    # NOTE: before any thread starts (the kernel's pool, packing, gRPC): they inherit it
    placement = place_worker(config.cpu_set, config.numa_node)
    parent = os.getppid()
    try:
        token = read_token(config.token_file)
    except TokenError as exc:
        print(f"ktserve expert: {exc}", file=sys.stderr)
        return 2
    refusal = listener_refusal(config.listen, token)
    if refusal:
        print(f"ktserve expert: {refusal}", file=sys.stderr)
        return 2
    worker = ExpertWorker(config)
    # NOTE: the handler takes no lock: Event.set does, and a second signal arriving inside the
    # first one's set() deadlocked the worker (seen: SIGTERM twice as `ktserve serve` died).
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    server, port, health = build_server(worker, config.listen, token)
    address = (
        config.listen
        if config.listen.startswith("unix:")
        else (f"{config.listen.rsplit(':', 1)[0]}:{port}")
    )
    if config.metrics_port:
        start_http_server(config.metrics_port, config.metrics_host,
                          registry=labeled_registry((worker.metrics.registry,),
                                                    worker.model_name))  # fmt: skip
    bound = "" if placement.memory_node is None else f", memory on node {placement.memory_node}"
    print(f"ktserve expert: listening on {address} (isa {worker.kernel.isa}, "
          f"{worker.kernel.num_threads} threads on CPUs {format_cpulist(placement.cpus)}{bound}, "
          f"pid {worker.pid})", flush=True)  # fmt: skip
    try:
        if config.model:
            worker.load(config.model, config.expert_range, config.weight_format,
                        progress=ProgressPrinter(sys.stderr, "loading experts"))  # fmt: skip
            set_serving(health, True)
            print(f"ktserve expert: serving {worker._describe()}", flush=True)
        while not (stopping or worker.exit_requested.is_set()):
            worker.exit_requested.wait(0.2)
        print("ktserve expert: draining", flush=True)
        set_serving(health, False)
        completed = worker.drain()
        print(f"ktserve expert: drained after {completed} calls; exiting", flush=True)
        return 0
    finally:
        server.stop(grace=1).wait()
        worker.close()
        if os.getppid() != parent and config.listen.startswith("unix:"):
            _remove_orphaned_socket(Path(config.listen.removeprefix("unix:")))


def _remove_orphaned_socket(path: Path) -> None:
    """Our parent (`ktserve serve`) died and will restart no one: the last of its workers to
    go removes the socket directory it made (ktserve-workers-*), once empty."""
    path.unlink(missing_ok=True)
    if path.parent.name.startswith("ktserve-workers-"):
        # NOTE: fails while another worker's socket is there: the last one removes it
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def run_convert(args: argparse.Namespace) -> int:
    import json

    from expert_service import packed_store
    from expert_service.shard import ProgressPrinter, load_shard

    config = from_args(ConvertConfig, args)
    shard = load_shard(config.model, config.expert_range, config.weight_format,
                       pack_threads=config.threads,
                       progress=ProgressPrinter(sys.stderr, "packing experts"))  # fmt: skip
    hf_config = json.loads((Path(config.model) / "config.json").read_text())
    out = packed_store.save(shard, config.out, hf_config)
    print(f"ktserve convert: wrote {shard.nbytes / 2**30:.2f} GiB ({len(shard.layers)} layers, "
          f"experts {shard.experts.start}-{shard.experts.stop - 1}, {shard.weight_format}) "
          f"to {out}")  # fmt: skip
    return 0
