"""The expert worker's and the converter's configuration; `ktserve expert` and `ktserve convert`
flags are their fields. Importable without torch: --help reads these fields."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ktserve.config_flags import flag
from ktserve.names import WEIGHT_FORMATS, check_weight_format
from ktserve.worker_token import TOKEN_CREATE_ENV, token_file_flag

# NOTE: kernels.isa.ISA_CODES' names; importing that module loads the kernel, which --help must not
ISAS = ("avx2", "avx512", "amx")


def default_num_threads() -> int:
    """All cores this process may use but one, which is left to the thread feeding the kernel."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def parse_experts(text: str | None) -> range | None:
    """An expert id range "START-END" (inclusive) as a range; None: all."""
    from ktserve.checkpoint import parse_expert_range  # NOTE: imports torch; --help must not

    return parse_expert_range(text) if text is not None else None


def parse_rows(text: str | None) -> range | None:
    """Intermediate rows "START-END" (inclusive) as a range; None: all."""
    from ktserve.checkpoint import parse_expert_range  # NOTE: imports torch; --help must not

    if text is None:
        return None
    try:
        return parse_expert_range(text)
    except ValueError:
        raise ValueError(
            f"--intermediate-rows {text!r} is not START-END, e.g. 0-767 (both inclusive)"
        ) from None


def parse_cpus(text: str | None) -> tuple[int, ...] | None:
    from ktserve.numa import parse_cpulist

    if text is None:
        return None
    cpus = parse_cpulist(text)
    if not cpus:
        raise ValueError(f"--cpus {text!r} names no CPU")
    return cpus


@dataclass(frozen=True)
class WorkerConfig:
    """CPU expert worker: the experts it holds, its kernel, where it listens."""

    model: str | None = flag(
        None,
        help="checkpoint directory (Hugging Face: config.json + *.safetensors), a GGUF file (a "
        "split set's first file, or a directory holding it; its experts are dequantized and "
        "packed in --format: docs/gguf.md) or a `ktserve convert` output, loaded at start; "
        "without it the worker waits for a LoadModel call",
    )
    listen: str = flag(
        "127.0.0.1:50061",
        help="gRPC address: HOST:PORT (port 0 picks a free one) or unix:/path.sock (default "
        "%(default)s). A TCP address, loopback too, needs a token (--token-file); a Unix socket "
        "without one must be in a directory only you can enter (0700)",
    )
    token_file: str | None = token_file_flag(
        "With one, the worker takes calls (all but health) only with it; without, only a Unix "
        f"socket listens. With {TOKEN_CREATE_ENV}=1 a missing file is created with a fresh "
        "token (0600)."
    )
    experts: str | None = flag(
        None, help="expert ids this worker holds, inclusive, e.g. 0-63 (default: all)"
    )
    intermediate_rows: str | None = flag(
        None,
        metavar="START-END",
        help="the rows of every held expert's intermediate dimension this worker holds, "
        "inclusive: gate and up rows and the matching down columns, e.g. 0-767 of 1536; "
        "workers that split the intermediate dimension each answer every call with a partial "
        "sum. START and END + 1 must be multiples of 64 (the kernel's packing block) or END the "
        "last row. Only from a checkpoint, not a `ktserve convert` directory (default: all rows)",
    )
    weight_format: str = flag(
        "int8",
        name="--format",
        choices=WEIGHT_FORMATS,
        help="weight format in RAM: bf16 (exact), int8 (per-row scales), int4 (group-32 scales) "
        "(default %(default)s)",
    )
    threads: int | None = flag(
        None, help=f"kernel threads (default: cores - 1 = {default_num_threads()})"
    )
    cpus: str | None = flag(
        None,
        metavar="LIST",
        help="run on these CPUs only, e.g. 0-15,32-47 (the kernel's threads inherit it; the "
        "default --threads follows it) (default: every CPU this process may use)",
    )
    numa_node: int | None = flag(
        None,
        metavar="NODE",
        help="bind the worker's memory (its shard) to this NUMA node (set_mempolicy "
        "MPOL_BIND); where the system refuses, a warning and unbound memory. `ktserve serve "
        "--numa auto` gives each worker a node and that node's CPUs as --cpus (default: off)",
    )
    isa: str | None = flag(
        None,
        choices=ISAS,
        help="force the kernel's instruction set (default: the best this CPU has)",
    )
    metrics_port: int = flag(0, help="serve Prometheus metrics on this port (default: off)")
    served_model_name: str | None = flag(
        None,
        help="the model_name label on every metric, as the GPU service labels its own (give "
        "both the same --served-model-name; default: the loaded model directory's name, as "
        "`ktserve serve` names the model it serves)",
    )
    metrics_host: str = flag(
        "127.0.0.1", help="address of the metrics endpoint (default %(default)s)"
    )
    spin_us: float = flag(
        200.0,
        help="how long a channel thread spins for work before it sleeps, in microseconds "
        "(default %(default)s)",
    )
    call_timing_samples: int = flag(
        0,
        help="keep the per-part timings (wake-up, dispatch, kernel, publish, bookkeeping) of "
        "each channel's last N MoE calls for GetStats (bench/bench_worker_call.py prints them; "
        "a small cost per call while on; default %(default)s: off)",
    )
    drain_timeout_s: float = flag(
        30.0,
        name="--drain-timeout",
        help="seconds SIGTERM waits for calls in flight (default %(default)s)",
    )
    share_experts: bool = flag(
        True,
        help="keep experts packed at load in a 0700 directory under /dev/shm (removed at exit), "
        "so a GPU service on this host maps the same pages to stream prefill to the GPU instead "
        "of holding a second copy; a `ktserve convert` directory is shared as it is (default: "
        "on; --no-share-experts keeps them in private memory)",
    )

    def __post_init__(self) -> None:
        check_weight_format(self.weight_format)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        parse_experts(self.experts)
        parse_rows(self.intermediate_rows)
        parse_cpus(self.cpus)
        if self.numa_node is not None and self.numa_node < 0:
            raise ValueError(f"--numa-node must be >= 0, got {self.numa_node}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.call_timing_samples < 0:
            raise ValueError(f"--call-timing-samples must be >= 0, got {self.call_timing_samples}")
        if self.drain_timeout_s <= 0:
            raise ValueError(f"--drain-timeout must be positive, got {self.drain_timeout_s}")

    @property
    def num_threads(self) -> int:
        return self.threads or default_num_threads()

    @property
    def expert_range(self) -> range | None:
        return parse_experts(self.experts)

    @property
    def intermediate_range(self) -> range | None:
        return parse_rows(self.intermediate_rows)

    @property
    def cpu_set(self) -> tuple[int, ...] | None:
        return parse_cpus(self.cpus)


@dataclass(frozen=True)
class ConvertConfig:
    """Conversion: a checkpoint's routed experts, quantized and packed into a directory."""

    model: str = flag(help="Hugging Face checkpoint directory or GGUF file")
    out: str = flag(help="output directory")
    experts: str | None = flag(None, help="expert ids, inclusive, e.g. 0-63 (default: all)")
    weight_format: str = flag(
        "int8", name="--format", choices=WEIGHT_FORMATS, help="weight format (default %(default)s)"
    )
    threads: int | None = flag(None, help="packing threads (default: all cores)")

    def __post_init__(self) -> None:
        check_weight_format(self.weight_format)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        parse_experts(self.experts)

    @property
    def expert_range(self) -> range | None:
        return parse_experts(self.experts)
