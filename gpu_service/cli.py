"""`ktserve serve`: the OpenAI-compatible server (its flags: ServeConfig's fields).

`ktserve serve MODEL` (a checkpoint directory or a GGUF file) binds the HTTP port first (a busy
port fails at once), loads the tokenizer, starts the expert workers (supervised subprocesses; or,
with --expert-address, connects to workers running on their own) and waits until they serve,
builds the GPU service on them, then serves HTTP until SIGINT/SIGTERM, after which it drains (new
requests 503, running ones finish within --shutdown-timeout, then are ended:
gpu_service/api/shutdown.py) and stops uvicorn, the engine (closing its ktshm channels) and the
workers it started (SIGTERM: they drain), in that order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from gpu_service.config import DEMO_MODEL_DIR
from gpu_service.serve_config import API_KEY_ENV, API_KEY_FILE_ENV, ServeConfig, WorkersConfig
from ktserve import envs
from ktserve.config_flags import add_flags, flag_name, from_args

SPAWN_FIELDS = ("expert_workers", "experts_per_worker", "weight_format", "threads",
                "expert_split", "numa")  # fmt: skip
# The experiment switches that were flags -> the environment variables that replaced them.
MOVED_FLAGS = {
    "--no-flashmla": f"{envs.FLASHMLA.name}=0",
    "--no-fused-kernels": f"{envs.FUSED_KERNELS.name}=0",
    "--no-graph-expert-calls": f"{envs.GRAPH_EXPERT_CALLS.name}=0",
    "--no-chain-decode-steps": f"{envs.CHAIN_DECODE_STEPS.name}=0",
    "--device-handoff": envs.DEVICE_HANDOFF.name,
    "--wire-dtype": envs.WIRE_DTYPE.name,
    "--min-prefill-chunk-tokens": envs.MIN_PREFILL_CHUNK_TOKENS.name,
    "--max-deferred-experts-per-token": envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name,
    "--gpu-experts-refresh": envs.GPU_EXPERTS_REFRESH_S.name,
}
# flags another flag replaced: refused, naming it
REPLACED_FLAGS = {
    "--mixed-step-time-factor": "--max-decode-stall-ms",
    "--mixed-step-time-ms": "--max-decode-stall-ms",
}


class Shutdown(BaseException):
    """SIGTERM/SIGINT while starting: unwind through every cleanup."""


def configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve a Mixture-of-Experts checkpoint over OpenAI- and Anthropic-compatible HTTP APIs "
        "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, "
        "/health, /metrics). Starts the "
        "CPU expert workers as supervised subprocesses (restarted if they die) unless "
        "--expert-address names workers already running, the GPU service, and the HTTP "
        "server; SIGINT/SIGTERM stop all of them (workers named by --expert-address keep "
        "running)."
    )
    add_flags(parser, ServeConfig)
    parser.add_argument(
        "--api-key",
        action=RefuseSecret,
        nargs="?",
        metavar="KEY",
        help=f"not accepted: a key on the command line is visible to every local user (ps); "
        f"use --api-key-file, {API_KEY_FILE_ENV} or {API_KEY_ENV}",
    )
    for name in MOVED_FLAGS:
        parser.add_argument(name, action=MovedFlag, nargs="?", help=argparse.SUPPRESS)
    for name in REPLACED_FLAGS:
        parser.add_argument(name, action=ReplacedFlag, nargs="?", help=argparse.SUPPRESS)
    parser.set_defaults(run=run_serve)


class RefuseSecret(argparse.Action):
    """A flag that would put a secret on the command line: refused, its value never echoed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"argument {option_string}: {self.help}")


class MovedFlag(argparse.Action):
    """An experiment switch that was a flag: refused, naming the variable that replaced it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(
            f"argument {option_string}: an experiment switch, no longer a flag: set the "
            f"environment variable {MOVED_FLAGS[option_string]} instead (docs/serving.md)"
        )


class ReplacedFlag(argparse.Action):
    """A flag another one replaced: refused, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"argument {option_string}: replaced by {REPLACED_FLAGS[option_string]} "
                     "(see --help)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """ServeConfig from the flags; without a model, the demo model (or how to pass one)."""
    if args.model_dir is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise ValueError(
                "no model given and the embedded demo model is not there "
                f"({DEMO_MODEL_DIR}).\nPass a Hugging Face checkpoint directory: "
                "ktserve serve /path/to/model  (it needs config.json, *.safetensors and the "
                "tokenizer files)"
            )
        args = argparse.Namespace(**{**vars(args), "model_dir": str(DEMO_MODEL_DIR)})
    from ktserve.gguf.files import is_gguf_path

    if not is_gguf_path(args.model_dir) and not (Path(args.model_dir) / "config.json").is_file():
        raise ValueError(
            f"{args.model_dir} is not a checkpoint: neither a directory with config.json nor a "
            "GGUF file (or a directory of *.gguf files)"
        )
    if args.expert_addresses is not None:
        check_no_spawn_flags(args)
    config = from_args(ServeConfig, args)
    return replace(config, http=config.http.with_api_key(os.environ))


def check_no_spawn_flags(args: argparse.Namespace) -> None:
    """The flags that shape the workers serve starts make no sense with --expert-address."""
    given = [flag_name(WorkersConfig, f) for f in SPAWN_FIELDS if getattr(args, f) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} the expert workers "
            "ktserve serve starts; with --expert-address the workers run on their own: give "
            "these to each `ktserve expert`"
        )


def run_serve(args: argparse.Namespace) -> int:
    from gpu_service.experts.errors import ExpertsUnavailable
    from gpu_service.launch import serve
    from gpu_service.workers.supervisor import WorkerStartError

    config = serve_config(args)
    signals: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        raise Shutdown(signal.Signals(signum).name)

    # NOTE: while loading, a signal unwinds through the cleanups; while it serves, uvicorn's
    # handlers are DrainingServer's (api/shutdown.py): it drains, then serve() returns.
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
    http = config.http
    key = f"$(cat {http.api_key_file})" if http.api_key_file else f"${API_KEY_ENV}"
    auth = f' -H "Authorization: Bearer {key}"' if http.api_key else ""
    print(
        f"ktserve serve: serving {config.model_name!r} at {url}/v1 (OpenAI API; health at "
        f"{url}/health, metrics at {url}/metrics)\n  try: curl {url}/v1/chat/completions "
        f"-H 'Content-Type: application/json'{auth} -d '{body}'",
        flush=True,
    )
