"""The GPU service's configuration: its scheduler's, its expert client's, and the service's own
settings that hold them. Importable without torch: `ktserve serve --help` reads these fields."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ktserve import wire
from ktserve.config_flags import flag
from ktserve.names import FLOAT_DTYPE_NAMES

MODEL_DTYPES = ("auto", *FLOAT_DTYPE_NAMES)
STREAM_PREFILL_MODES = ("auto", "on", "off")
DEVICE_ENV = "KTSERVE_DEVICE"
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: how many requests and tokens one step holds."""

    max_num_seqs: int = flag(
        64, help="most requests decoded together; more wait (default %(default)s)"
    )
    max_num_batched_tokens: int = flag(
        2048,
        help="most tokens in one forward step; longer prompts are fed in chunks of what is left "
        "(default %(default)s)",
    )
    max_model_len: int | None = flag(
        None,
        help="context length in tokens, prompt plus completion (default: the model's, capped "
        "at 8192)",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class ExpertClientConfig:
    """Expert client: the GPU service's side of the expert workers' channels.

    workers: the workers' gRPC addresses (their shards must cover every expert); `ktserve serve`
    fills in those of the workers it uses. Each channel holds num_slots calls, spins spin_us for
    a reply before it blocks, and is pinned (page-locked) on CUDA when pin_memory.
    """

    workers: tuple[str, ...] = ()
    wire_dtype: str = flag(
        "bfloat16",
        choices=wire.X_DTYPES,
        help="dtype of hidden states sent to the expert workers (default %(default)s; float32 "
        "is exact)",
    )
    worker_timeout_s: float = flag(
        30.0,
        name="--worker-timeout",
        help="seconds requests wait for a dead expert worker to come back before they fail "
        "with 503 (default %(default)s)",
    )
    num_slots: int = 4
    spin_us: float = 500.0
    pin_memory: bool = True
    token: str | None = field(default=None, repr=False)  # the workers' (ktserve/worker_token.py)

    def __post_init__(self) -> None:
        if self.wire_dtype not in wire.X_DTYPES:
            raise ValueError(
                f"--wire-dtype must be one of {wire.X_DTYPES}, got {self.wire_dtype!r}"
            )
        if self.worker_timeout_s <= 0:
            raise ValueError(f"--worker-timeout must be positive, got {self.worker_timeout_s}")


@dataclass(frozen=True)
class GPUServiceConfig:
    """GPU service: the model's GPU part, its KV cache, hot experts and CUDA graphs.

    The KV cache takes what gpu_memory_fraction of the free GPU memory holds after the weights
    (unless kv_cache_tokens says); CUDA graphs are captured in the memory the fraction leaves.
    """

    model_dir: str = flag(
        positional=True,
        nargs="?",
        metavar="MODEL_DIR",
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); "
        f"default: the embedded demo model at {DEMO_MODEL_DIR}",
    )
    device: str | None = flag(
        None,
        env=DEVICE_ENV,
        help=f"torch device of the GPU part, e.g. cuda:1 or cpu (default: the {DEVICE_ENV} "
        "environment variable; unset: cuda if available)",
    )
    dtype: str = flag(
        "auto",
        choices=MODEL_DTYPES,
        help="dtype of the model's GPU part (default %(default)s: bfloat16 on CUDA, float32 on "
        "the CPU)",
    )
    kv_cache_tokens: int | None = flag(
        None,
        help="KV cache size in tokens (default: what 90%% of the free GPU memory holds; 32768 "
        "on the CPU)",
    )
    gpu_memory_fraction: float = 0.9
    prefix_caching: bool = flag(
        True,
        name="--no-prefix-caching",
        help="compute every prompt in full (by default KV-cache blocks are reused across "
        "requests that share a prefix: the prefill, and its expert calls, start after it)",
    )
    kv_host_cache_gib: float = flag(
        0.0,
        metavar="GIB",
        help="host RAM for a second tier of the prefix cache: KV blocks evicted from the GPU "
        "cache are copied there and brought back when a prompt reuses them (default "
        "%(default)s: none)",
    )
    gpu_experts: int = flag(
        0,
        help="hot routed experts per MoE layer to keep on the GPU, computed there while the CPU "
        "workers do the rest; chosen from the workers' activation counts (default %(default)s)",
    )
    gpu_experts_refresh_s: float = flag(
        300.0,
        name="--gpu-experts-refresh",
        metavar="SECONDS",
        help="with --gpu-experts: every SECONDS, make each layer's most used experts of that "
        "interval the GPU ones (counted on the GPU; 0: keep the first choice; never with "
        "--expert-placement) (default %(default)s)",
    )
    expert_placement: str | None = flag(
        None,
        metavar="FILE",
        help='JSON {"layer": [expert ids]} naming the experts to keep on the GPU per layer',
    )
    cuda_graphs: bool = flag(
        True,
        name="--no-cuda-graphs",
        help="run every decode step eagerly (by default, on CUDA, the decode step's GPU "
        "segments between MoE calls are captured once per batch size and replayed as CUDA "
        "graphs)",
    )
    graph_expert_calls: bool = flag(
        True,
        name="--no-graph-expert-calls",
        help="with CUDA graphs, call the expert workers from the host between the graphs of a "
        "decode step's segments (by default the GPU stream itself hands each MoE layer's "
        "hidden states to the workers and waits for their replies, so a step is one graph; "
        "--gpu-experts and --expert-placement always use segments)",
    )
    max_deferred_experts_per_token: int = flag(
        0,
        metavar="N",
        help="expert deferral, speed for quality: each token's N lowest-weight routed experts "
        "of an MoE layer are computed by the CPU while the GPU runs the next layer, their output "
        "joining the next MoE layer's instead of their own (the last MoE layer defers none); N "
        "must be below the model's experts per token (default %(default)s: off)",
    )
    stream_prefill: str = flag(
        "auto",
        choices=STREAM_PREFILL_MODES,
        help="prefill through the GPU: a step's prefill chunk has its routed experts computed on "
        "the GPU from the workers' packed weights, streamed over PCIe layer by layer (the next "
        "layer's copy overlapping this one's compute; two layers' experts on the GPU), while "
        "decode rows of the same step go to the CPU workers. auto: for chunks at least as long "
        "as a cost model measured at start-up says pays off (printed; CUDA only); on: every "
        "chunk; off: never (default %(default)s). Needs workers on this host that share their "
        "packed experts (ktserve expert --share-experts, the default)",
    )
    cuda_graph_max_batch: int = flag(
        32,
        help="largest decode batch run with CUDA graphs; larger ones run eagerly (default "
        "%(default)s)",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    experts: ExpertClientConfig = field(default_factory=ExpertClientConfig)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 16:
            raise ValueError(f"--kv-cache-tokens must be >= 16, got {self.kv_cache_tokens}")
        if self.kv_host_cache_gib < 0:
            raise ValueError(f"--kv-host-cache-gib must be >= 0, got {self.kv_host_cache_gib}")
        if self.kv_host_cache_gib and not self.prefix_caching:
            raise ValueError("--kv-host-cache-gib needs prefix caching (drop --no-prefix-caching)")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.gpu_experts < 0:
            raise ValueError(f"--gpu-experts must be >= 0, got {self.gpu_experts}")
        if self.gpu_experts_refresh_s < 0:
            raise ValueError(
                f"--gpu-experts-refresh must be >= 0, got {self.gpu_experts_refresh_s}"
            )
        if self.expert_placement is not None and not Path(self.expert_placement).is_file():
            raise ValueError(f"--expert-placement {self.expert_placement!r} is not a file")
        if self.stream_prefill not in STREAM_PREFILL_MODES:
            raise ValueError(
                f"--stream-prefill must be one of {STREAM_PREFILL_MODES}, got "
                f"{self.stream_prefill!r}"
            )
        if self.max_deferred_experts_per_token < 0:
            raise ValueError(
                "--max-deferred-experts-per-token must be >= 0, got "
                f"{self.max_deferred_experts_per_token}"
            )
        if self.max_deferred_experts_per_token and self.experts.num_slots < 3:
            raise ValueError(
                "--max-deferred-experts-per-token needs 3 slots per expert channel (a deferred "
                f"call, the next layer's two), got num_slots={self.experts.num_slots}"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError(
                f"--cuda-graph-max-batch must be >= 1, got {self.cuda_graph_max_batch}"
            )

    def with_workers(self, workers: tuple[str, ...], token: str | None = None) -> GPUServiceConfig:
        """This service on the expert workers at these gRPC addresses (calls carry token)."""
        return replace(self, experts=replace(self.experts, workers=workers, token=token))
