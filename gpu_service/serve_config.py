"""`ktserve serve`'s configuration: the HTTP API, the expert workers, chat output and the GPU
service, one dataclass each; its flags are their fields'."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpu_service.config import GPUServiceConfig
from ktserve import envs
from ktserve.config_flags import comma_list, flag
from ktserve.names import WEIGHT_FORMATS
from ktserve.worker_token import token_file_flag

log = logging.getLogger("ktserve.serve")

API_KEY_ENV = envs.API_KEY.name
API_KEY_FILE_ENV = envs.API_KEY_FILE.name
MiB = 1 << 20
# NOTE: the names of gpu_service.api.tool_parsers.PARSERS and api.reasoning.REASONING_PARSERS
# (a test keeps them equal): --help must not import the API.
TOOL_CALL_PARSERS = ("glm45", "qwen3_coder", "hermes", "deepseek_v3", "mistral")
EXPERT_SPLITS = ("experts", "intermediate")
NUMA_MODES = ("auto", "off")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class HTTPConfig:
    """HTTP API: where it listens, who may use it, and how much it takes on."""

    host: str = flag(
        "127.0.0.1",
        help="HTTP address to bind (default %(default)s; 0.0.0.0 exposes the server to the "
        "network)",
    )
    port: int = flag(8000, help="HTTP port (default %(default)s; 0 picks a free one)")
    api_key_file: str | None = flag(
        None,
        env=API_KEY_FILE_ENV,
        metavar="PATH",
        help="require 'Authorization: Bearer KEY' on every route but /health (which then "
        "tells others only ok or not), KEY being this file's first line (default: the "
        f"{API_KEY_FILE_ENV} environment variable; without either, the key in {API_KEY_ENV}; "
        "without that, no key). The key itself is never a flag: a command line is visible to "
        "every local user (ps, /proc/PID/cmdline)",
    )
    metrics_public: bool = flag(
        False,
        name="--metrics-public",
        help="serve /metrics without the API key (for a Prometheus that cannot send it)",
    )
    served_model_name: str | None = flag(
        None,
        help="the model name clients send and /v1/models lists (default: the checkpoint "
        "directory's name, or the GGUF file's without .gguf and its split suffix)",
    )
    max_request_bytes: int = flag(
        8 * MiB,
        metavar="BYTES",
        help="largest request body in bytes; a larger one is answered 413 before it is read "
        "whole (default %(default)s)",
    )
    request_read_timeout_s: float = flag(
        60.0,
        name="--request-read-timeout",
        metavar="SECONDS",
        help="seconds a request's whole body may take to arrive after its headers; a slower one "
        "is answered 408 and its connection closed. A request counts against "
        "--max-waiting-requests only once its body is read (default %(default)s)",
    )
    max_waiting_requests: int = flag(
        256,
        metavar="N",
        help="requests that may wait for the engine (tokenized or queued) beyond those it runs; "
        "more are answered 429 with a Retry-After from the queue: waiting requests x recent "
        "mean run time / --max-num-seqs, 1 to 60 s (default %(default)s)",
    )
    request_timeout_s: float | None = flag(
        None,
        name="--request-timeout",
        metavar="SECONDS",
        help="seconds a request may take from the moment it is queued; later it ends with a "
        "504 (a stream: an error event) whose code is deadline_exceeded. A request's own "
        "`timeout` field can only shorten it (default: no limit)",
    )
    shutdown_timeout_s: float = flag(
        30.0,
        name="--shutdown-timeout",
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, seconds the running requests may take to finish while new ones "
        "get 503; then each is ended with an error (a stream: an error event and [DONE]) "
        "(default %(default)s)",
    )
    access_log: bool = flag(
        True,
        name="--no-access-log",
        help="do not log a line per request (method, path, status, seconds, prompt and "
        "completion tokens) to the ktserve.access logger",
    )
    max_stored_responses: int = flag(
        1024,
        metavar="N",
        help="/v1/responses answers kept in memory (each for an hour, the oldest dropped first) "
        "for previous_response_id and GET /v1/responses/{id}; 0 keeps none, and store true is "
        "then refused (default %(default)s)",
    )
    # NOTE: never a flag; read from api_key_file or API_KEY_ENV by with_api_key().
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.request_read_timeout_s <= 0:
            raise ValueError(
                f"--request-read-timeout must be positive, got {self.request_read_timeout_s}"
            )
        if self.max_waiting_requests < 0:
            raise ValueError(
                f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}"
            )
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout_s}")
        if self.max_stored_responses < 0:
            raise ValueError(
                f"--max-stored-responses must be >= 0, got {self.max_stored_responses}"
            )
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")

    def with_api_key(self, environ: Mapping[str, str]) -> HTTPConfig:
        """This config with api_key read from api_key_file, else from environ[API_KEY_ENV]."""
        if self.api_key is not None:
            return self
        if self.api_key_file is not None:
            return replace(self, api_key=read_api_key(self.api_key_file))
        return replace(self, api_key=environ.get(API_KEY_ENV) or None)


def read_api_key(path: str) -> str:
    """The first line of the file at path, stripped (ValueError for a missing or empty one; the
    messages never quote the file's content)."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the API key file {path} is not UTF-8 text") from None
    if not key:
        raise ValueError(f"the API key file {path} is empty; its first line must be the key")
    mode = os.stat(path).st_mode
    if mode & 0o077:
        log.warning("the API key file %s is readable by other users (mode %o): chmod 600 it",
                    path, stat.S_IMODE(mode))  # fmt: skip
    return key


@dataclass(frozen=True)
class WorkersConfig:
    """Expert workers: started here and supervised, or running on their own (--expert-address)."""

    expert_addresses: tuple[str, ...] | None = flag(
        None,
        name="--expert-address",
        action="extend",
        type=comma_list,
        metavar="HOST:PORT",
        help="connect to a CPU expert worker that runs on its own (`ktserve expert --model DIR "
        "--experts RANGE --listen HOST:PORT`, e.g. another container) instead of starting "
        "workers here; repeat the flag or separate addresses with commas. The workers' "
        "--experts ranges must hold every routed expert exactly once (checked at start). A "
        "worker that dies is waited for (--worker-timeout) and re-attached once it serves at "
        "the same address again; restarting it is up to whoever started it. Not combinable "
        "with --expert-workers, --experts-per-worker, --format, --threads",
    )
    worker_token_file: str | None = token_file_flag(
        "Sent to the workers of --expert-address; workers started here get a fresh one and "
        "Unix sockets in a 0700 directory instead."
    )
    expert_workers: int = flag(
        1,
        help="CPU expert worker processes to start; each holds an equal share of the routed "
        "experts (default %(default)s)",
    )
    experts_per_worker: tuple[str, ...] | None = flag(
        None,
        type=comma_list,
        metavar="RANGES",
        help="each worker's expert ids, comma-separated inclusive ranges, one per worker, e.g. "
        "0-95,96-255 (default: an even split)",
    )
    weight_format: str = flag(
        "int8",
        name="--format",
        choices=WEIGHT_FORMATS,
        help="routed experts' format in RAM: bf16 (exact), int8 (per-row scales), int4 "
        "(group-32 scales) (default %(default)s)",
    )
    expert_split: str = flag(
        "experts",
        choices=EXPERT_SPLITS,
        help="how the routed experts are divided among the workers: experts (each worker holds "
        "a range of expert ids, --experts-per-worker) or intermediate (each worker holds a "
        "slice of every expert's intermediate dimension: worker w of W the rows [w*I/W, "
        "(w+1)*I/W) of gate and up and the matching columns of down, so every token's work is "
        "spread evenly over the workers; I/W must be a multiple of 64) (default %(default)s)",
    )
    numa: str = flag(
        "off",
        choices=NUMA_MODES,
        help="auto: one expert worker per NUMA node (the nodes with CPUs this process may use), "
        "its threads on that node's CPUs and its shard's memory bound to that node; a "
        "one-node machine runs --expert-workers workers, unpinned, as with off. off: the "
        "workers run where the OS puts them (default %(default)s)",
    )
    threads: int | None = flag(
        None,
        help="kernel threads per expert worker (default: its CPUs - 1; with --numa auto, its "
        "node's CPUs - 1)",
    )
    restart_workers: bool = flag(
        True, name="--no-restart-workers", help="do not restart expert workers that exit"
    )
    worker_start_timeout_s: float = flag(
        3600.0,
        name="--worker-start-timeout",
        help="seconds an expert worker may take to load, or to come up and load when named by "
        "--expert-address (default %(default)s)",
    )

    def __post_init__(self) -> None:
        from ktserve.checkpoint import parse_expert_range  # NOTE: imports torch; --help must not

        if self.expert_workers < 1:
            raise ValueError(f"--expert-workers must be >= 1, got {self.expert_workers}")
        if self.experts_per_worker is not None:
            if len(self.experts_per_worker) != self.expert_workers:
                raise ValueError(
                    f"--experts-per-worker names {len(self.experts_per_worker)} ranges for "
                    f"{self.expert_workers} expert workers; give one range per worker"
                )
            for text in self.experts_per_worker:
                parse_expert_range(text)
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"--format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}"
            )
        if self.expert_split not in EXPERT_SPLITS:
            raise ValueError(
                f"--expert-split must be one of {EXPERT_SPLITS}, got {self.expert_split!r}"
            )
        if self.expert_split == "intermediate" and self.experts_per_worker is not None:
            raise ValueError(
                "--experts-per-worker gives each worker expert ids; with --expert-split "
                "intermediate every worker holds every expert (a slice of each)"
            )
        if self.numa not in NUMA_MODES:
            raise ValueError(f"--numa must be one of {NUMA_MODES}, got {self.numa!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.worker_start_timeout_s <= 0:
            raise ValueError(
                f"--worker-start-timeout must be positive, got {self.worker_start_timeout_s}"
            )
        if self.expert_addresses is not None:
            check_addresses(self.expert_addresses)


@dataclass(frozen=True)
class ChatConfig:
    """Chat output: the tokenizer and chat template, how tool calls and reasoning are written and
    read, and constrained decoding."""

    tokenizer: str | None = flag(
        None,
        metavar="DIR",
        help="a Hugging Face directory whose tokenizer and chat template to use instead of the "
        "checkpoint's (a GGUF checkpoint's come from its metadata: tokenizer.ggml.*, "
        "tokenizer.chat_template) (default: the checkpoint's own)",
    )
    tool_call_parser: str | None = flag(
        None,
        choices=(*TOOL_CALL_PARSERS, "none"),
        help="the format of tool calls: hermes (<tool_call>{json}</tool_call>: Qwen3, Qwen2.5, "
        "Hermes), deepseek_v3 (<｜tool▁calls▁begin｜>: DeepSeek-V3/R1), mistral ([TOOL_CALLS]: "
        "Mistral, Mixtral), glm45 (<tool_call>NAME<arg_key>: GLM-4.5/4.6/4.7), qwen3_coder "
        "(<tool_call><function=NAME>: Qwen3-Coder); none refuses requests with tools (default: "
        "the format the chat "
        "template writes, else the model family's)",
    )
    reasoning_parser: str | None = flag(
        None,
        choices=(*REASONING_PARSERS, "none"),
        help="split the thinking (<think>...</think>) into reasoning_content: deepseek_r1 (the "
        "output starts in the thinking, opening tag or not), qwen3 (thinking only where it is "
        "opened); none leaves it in content (default: deepseek_r1 or qwen3 by the model family "
        "when the chat template writes <think>, else none)",
    )
    grammar_cache_size: int = flag(
        64,
        help="compiled grammars kept for reuse (tool_choice required or named, response_format "
        "json_object/json_schema) (default %(default)s)",
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, "none", *TOOL_CALL_PARSERS):
            raise ValueError(
                f"--tool-call-parser must be one of {TOOL_CALL_PARSERS} or none, got "
                f"{self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ValueError(
                f"--reasoning-parser must be one of {REASONING_PARSERS} or none, got "
                f"{self.reasoning_parser!r}"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"--tokenizer {self.tokenizer} is not a directory")
        if self.grammar_cache_size < 1:
            raise ValueError(f"--grammar-cache-size must be >= 1, got {self.grammar_cache_size}")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """`ktserve serve`: the HTTP API, the expert workers and the GPU service on them."""

    http: HTTPConfig = field(default_factory=HTTPConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    gpu: GPUServiceConfig

    @property
    def model_dir(self) -> str:
        return self.gpu.model_dir

    @property
    def model_name(self) -> str:
        """--served-model-name, else the checkpoint directory's name (a GGUF file's name without
        .gguf and its split suffix)."""
        from ktserve.gguf.files import model_name

        return self.http.served_model_name or model_name(self.model_dir)


def check_addresses(addresses: tuple[str, ...]) -> None:
    """ValueError unless each is HOST:PORT (or unix:/path) and none repeats."""
    if not addresses:
        raise ValueError("--expert-address needs at least one HOST:PORT")
    for address in addresses:
        if address.startswith("unix:"):
            continue
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(
                f"--expert-address {address!r} is not HOST:PORT (e.g. expert-0:50061) or "
                "unix:/path.sock"
            )
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ValueError(f"--expert-address names {', '.join(repeated)} more than once")
