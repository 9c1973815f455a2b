"""`ktserve`: `serve` (the OpenAI-compatible server), plus `expert` and `convert` from
expert_service.

`ktserve serve MODEL_DIR` binds the HTTP port first (a busy port fails at once), loads the
tokenizer, starts the expert workers (supervised subprocesses; or, with --expert-address, connects
to workers running on their own) and waits until they serve, builds the GPU service on them, then
serves HTTP until SIGINT/SIGTERM, after which it stops uvicorn, the engine (closing its ktshm
channels) and the workers it started (SIGTERM: they drain), in that order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from expert_service.cli import add_convert_parser, add_expert_parser, run_command
from gpu_service.config import DEMO_MODEL_DIR, MODEL_DTYPES
from gpu_service.serve_config import API_KEY_ENV, DEVICE_ENV, ServeConfig
from ktserve.names import WEIGHT_FORMATS

D = ServeConfig  # defaults


class Shutdown(BaseException):
    """SIGTERM/SIGINT while starting: unwind through every cleanup."""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a Mixture-of-Experts checkpoint over an OpenAI-compatible HTTP API "
            "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). Starts the "
            "CPU expert workers as supervised subprocesses (restarted if they die) unless "
            "--expert-address names workers already running, the GPU service, and the HTTP "
            "server; SIGINT/SIGTERM stop all of them (workers named by --expert-address keep "
            "running)."
        ),
    )
    p.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer "
        f"files); default: the embedded demo model at {DEMO_MODEL_DIR}",
    )
    p.add_argument(
        "--host",
        default=D.host,
        help="HTTP address to bind (default %(default)s; "
        "0.0.0.0 exposes the server to the network)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=D.port,
        help="HTTP port (default %(default)s; 0 picks a free one)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
        f"{API_KEY_ENV} environment variable; unset: no key)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: the directory's name)",
    )
    p.add_argument(
        "--expert-address",
        dest="expert_addresses",
        action="append",
        metavar="HOST:PORT",
        help="connect to a CPU expert worker that runs on its own (`ktserve expert --model DIR "
        "--experts RANGE --listen HOST:PORT`, e.g. another container) instead of starting "
        "workers here; repeat the flag or separate addresses with commas. The workers' "
        "--experts ranges must hold every routed expert exactly once (checked at start). A "
        "worker that dies is waited for (--worker-timeout) and re-attached once it serves at "
        "the same address again; restarting it is up to whoever started it. Not combinable "
        "with --expert-workers, --experts-per-worker, --format, --threads",
    )
    p.add_argument(
        "--expert-workers",
        type=int,
        help=f"CPU expert worker processes to start; each holds an equal share of the routed "
        f"experts (default {D.expert_workers})",
    )
    p.add_argument(
        "--experts-per-worker",
        metavar="RANGES",
        help="each worker's expert ids, comma-separated inclusive ranges, one per "
        "worker, e.g. 0-95,96-255 (default: an even split)",
    )
    p.add_argument(
        "--format",
        dest="weight_format",
        choices=WEIGHT_FORMATS,
        help="routed experts' format in RAM: bf16 (exact), int8 (per-row scales), "
        f"int4 (group-32 scales) (default {D.weight_format})",
    )
    p.add_argument(
        "--threads", type=int, help="kernel threads per expert worker (default: cores - 1)"
    )
    p.add_argument(
        "--gpu-experts",
        type=int,
        default=D.gpu_experts,
        help="hot routed experts per MoE layer to keep on the GPU, computed there while the CPU "
        "workers do the rest; chosen from the workers' activation counts (default %(default)s)",
    )
    p.add_argument(
        "--gpu-experts-refresh",
        dest="gpu_experts_refresh_s",
        type=float,
        default=D.gpu_experts_refresh_s,
        metavar="SECONDS",
        help="with --gpu-experts: every SECONDS, make each layer's most used experts of that "
        "interval the GPU ones (counted on the GPU; 0: keep the first choice) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--expert-placement",
        metavar="FILE",
        help='JSON {"layer": [expert ids]} naming the experts to keep on the GPU per layer',
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context length in tokens, prompt plus completion (default: the "
        "model's, capped at 8192)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="KV cache size in tokens (default: what 90%% of the free GPU memory "
        "holds; 32768 on the CPU)",
    )
    p.add_argument(
        "--dtype",
        default=D.dtype,
        choices=MODEL_DTYPES,
        help="dtype of the model's GPU part (default %(default)s: bfloat16 on CUDA, float32 on "
        "the CPU)",
    )
    p.add_argument(
        "--wire-dtype",
        default=D.wire_dtype,
        choices=("bfloat16", "float32"),
        help="dtype of hidden states sent to the expert workers (default "
        "%(default)s; float32 is exact)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=D.max_num_seqs,
        help="most requests decoded together; more wait (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=D.max_num_batched_tokens,
        help="most tokens in one forward step; longer prompts are fed in chunks of what is left "
        "(default %(default)s)",
    )
    p.add_argument(
        "--device",
        default=os.environ.get(DEVICE_ENV) or None,
        help="torch device of the GPU part, e.g. cuda:1 or cpu (default: the "
        f"{DEVICE_ENV} environment variable; unset: cuda if available)",
    )
    p.add_argument(
        "--worker-timeout",
        dest="worker_timeout_s",
        type=float,
        default=D.worker_timeout_s,
        help="seconds requests wait for a dead expert worker to come back before "
        "they fail with 503 (default %(default)s)",
    )
    p.add_argument(
        "--no-restart-workers",
        dest="restart_workers",
        action="store_false",
        help="do not restart expert workers that exit",
    )
    p.add_argument(
        "--worker-start-timeout",
        dest="worker_start_timeout_s",
        type=float,
        default=D.worker_start_timeout_s,
        help="seconds an expert worker may take to load, or to come up and load when named by "
        "--expert-address (default %(default)s)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every decode step eagerly (by default, on CUDA, the decode step's GPU "
        "segments between MoE calls are captured once per batch size and replayed as CUDA graphs)",
    )
    p.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=D.cuda_graph_max_batch,
        help="largest decode batch run with CUDA graphs; larger ones run eagerly "
        "(default %(default)s)",
    )
    p.set_defaults(run=run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ktserve",
        description="Serve huge Mixture-of-Experts models on one GPU plus host RAM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    add_expert_parser(sub)
    add_convert_parser(sub)
    return parser


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from the flags; exits 2 (with how to pass a model) when there is none."""
    model_dir = args.model_dir
    if model_dir is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise SystemExit(
                "ktserve serve: error: no model given and the embedded demo model is not there "
                f"({DEMO_MODEL_DIR}).\nPass a Hugging Face checkpoint directory: "
                "ktserve serve /path/to/model  (it needs config.json, *.safetensors and the "
                "tokenizer files)"
            )
        model_dir = str(DEMO_MODEL_DIR)
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a checkpoint directory: it has no config.json")
    ranges = args.experts_per_worker
    addresses = parse_addresses(args.expert_addresses)
    if addresses is not None:
        check_no_spawn_flags(args)
    return ServeConfig(
        model_dir=model_dir,
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        expert_workers=D.expert_workers if args.expert_workers is None else args.expert_workers,
        experts_per_worker=tuple(r.strip() for r in ranges.split(",")) if ranges else None,
        weight_format=args.weight_format or D.weight_format,
        threads=args.threads,
        gpu_experts=args.gpu_experts,
        gpu_experts_refresh_s=args.gpu_experts_refresh_s,
        expert_placement=args.expert_placement,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        dtype=args.dtype,
        wire_dtype=args.wire_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        worker_timeout_s=args.worker_timeout_s,
        restart_workers=args.restart_workers,
        worker_start_timeout_s=args.worker_start_timeout_s,
        cuda_graphs=args.cuda_graphs,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        expert_addresses=addresses,
    )


def parse_addresses(values: list[str] | None) -> tuple[str, ...] | None:
    """--expert-address values (each may hold several, comma-separated) as one tuple."""
    if values is None:
        return None
    return tuple(a.strip() for value in values for a in value.split(",") if a.strip())


def check_no_spawn_flags(args: argparse.Namespace) -> None:
    """The flags that shape the workers serve starts make no sense with --expert-address."""
    given = [
        flag
        for flag, value in (
            ("--expert-workers", args.expert_workers),
            ("--experts-per-worker", args.experts_per_worker),
            ("--format", args.weight_format),
            ("--threads", args.threads),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} the expert workers "
            "ktserve serve starts; with --expert-address the workers run on their own: give "
            "these to each `ktserve expert`"
        )


def run_serve(args: argparse.Namespace) -> int:
    from gpu_service.api.server import serve
    from gpu_service.moe_client import ExpertsUnavailable
    from gpu_service.supervisor import WorkerStartError

    config = serve_config(args)
    signals: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        raise Shutdown(signal.Signals(signum).name)

    # NOTE: while loading, a signal unwinds through the cleanups; uvicorn installs its own
    # handlers while it serves (and re-raises the signal once it has stopped: Shutdown again).
    # Raised inside a C extension (torch), Shutdown may come out as another exception: after a
    # signal, any exception is the shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        return serve(config, on_ready=print_ready)
    except Shutdown:
        return 0
    except BaseException as exc:
        if signals:
            return 0
        if isinstance(exc, WorkerStartError | ExpertsUnavailable):
            print(f"ktserve serve: error: {exc}", file=sys.stderr)
            return 1
        raise


def print_ready(url: str, config: ServeConfig) -> None:
    body = json.dumps(
        {"model": config.model_name, "messages": [{"role": "user", "content": "Hello!"}]}
    )
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if config.api_key else ""
    print(
        f"ktserve serve: serving {config.model_name!r} at {url}/v1 (OpenAI API; health at "
        f"{url}/health, metrics at {url}/metrics)\n  try: curl {url}/v1/chat/completions "
        f"-H 'Content-Type: application/json'{auth} -d '{body}'",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
