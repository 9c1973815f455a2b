"""The GPU service's configuration: its scheduler's, its expert client's, and the service's own
settings that hold them. Importable without torch: `ktserve serve --help` reads these fields."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ktserve import envs, wire
from ktserve.config_flags import env_field, flag
from ktserve.names import FLOAT_DTYPE_NAMES

MODEL_DTYPES = ("auto", *FLOAT_DTYPE_NAMES)
KV_CACHE_DTYPES = ("auto", "fp8")
GPU_WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int4")
STREAM_PREFILL_MODES = ("auto", "on", "off")
DEVICE_ENV = envs.DEVICE.name
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
        help="context length in tokens, prompt plus completion (default: the model's own maximum, "
        "max_position_embeddings or YaRN's original_max_position_embeddings x factor, bounded by "
        "what the KV cache holds)",
    )
    max_decode_stall_ms: float | None = flag(
        None,
        metavar="MS",
        help="while requests decode, a prompt joining them is fed in chunks that add at most "
        "about MS milliseconds to their steps (as the step cost model, fitted online, predicts), "
        "though never cut below the size from which prefill streams experts to the GPU where "
        "that is faster. Default: no target; each chunk is the smallest that costs about as "
        "little per token as any, which gets both the prompt and the decodes done soonest "
        f"(its floor under a target: {envs.MIN_PREFILL_CHUNK_TOKENS.name})",
    )
    min_prefill_chunk_tokens: int = env_field(envs.MIN_PREFILL_CHUNK_TOKENS)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_decode_stall_ms is not None and not self.max_decode_stall_ms > 0:
            raise ValueError(f"--max-decode-stall-ms must be > 0, got {self.max_decode_stall_ms}")
        if self.min_prefill_chunk_tokens < 1:
            raise ValueError(
                f"{envs.MIN_PREFILL_CHUNK_TOKENS.name} must be >= 1, got "
                f"{self.min_prefill_chunk_tokens}"
            )

    @property
    def max_decode_stall_s(self) -> float | None:
        return None if self.max_decode_stall_ms is None else self.max_decode_stall_ms / 1e3

    @property
    def min_chunk_tokens(self) -> int:
        return min(self.min_prefill_chunk_tokens, self.max_num_batched_tokens)


@dataclass(frozen=True)
class ExpertClientConfig:
    """Expert client: the GPU service's side of the expert workers' channels.

    workers: the workers' gRPC addresses (their shards must cover every expert); `ktserve serve`
    fills in those of the workers it uses. Each channel holds num_slots calls, spins spin_us for
    a reply before it blocks, and is pinned (page-locked) on CUDA when pin_memory.
    """

    workers: tuple[str, ...] = ()
    wire_dtype: str = env_field(envs.WIRE_DTYPE)
    worker_timeout_s: float = flag(
        30.0,
        name="--worker-timeout",
        help="seconds requests wait for a dead expert worker to come back before they fail "
        "with 503 (default %(default)s)",
    )
    device_handoff: str = env_field(envs.DEVICE_HANDOFF)
    num_slots: int = 4
    spin_us: float = 500.0
    handoff_stamps: bool = False  # benchmarks: the GPU times its hand-off (device_kernels.py)
    pin_memory: bool = True
    token: str | None = field(default=None, repr=False)  # the workers' (ktserve/worker_token.py)

    def __post_init__(self) -> None:
        if self.wire_dtype not in wire.X_DTYPES:
            raise ValueError(
                f"{envs.WIRE_DTYPE.name} must be one of {wire.X_DTYPES}, got {self.wire_dtype!r}"
            )
        if self.worker_timeout_s <= 0:
            raise ValueError(f"--worker-timeout must be positive, got {self.worker_timeout_s}")


@dataclass(frozen=True)
class GPUServiceConfig:
    """GPU service: the model's GPU part, its KV cache, hot experts and CUDA graphs.

    The KV cache takes what gpu_memory_utilization of the GPU's total memory leaves after the
    weights, the activations' measured peak, the CUDA graphs' reserve and a headroom (unless
    kv_cache_tokens says): memory_plan.py.
    """

    model_dir: str = flag(
        positional=True,
        nargs="?",
        metavar="MODEL",
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), "
        "or a GGUF file (for a split set, its first file: NAME-00001-of-0000N.gguf; or a "
        "directory holding it) with the config, tokenizer and chat template in its metadata "
        f"(docs/gguf.md); default: the embedded demo model at {DEMO_MODEL_DIR}",
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
        help="KV cache size in tokens (default: what --gpu-memory-utilization leaves for it; "
        "32768 on the CPU)",
    )
    gpu_memory_utilization: float = flag(
        0.9,
        metavar="FRACTION",
        help="fraction of the GPU's total memory ktserve may use: weights, KV cache, CUDA "
        "graphs, activations (measured by a profiling forward of --max-num-batched-tokens "
        "tokens at start-up) and headroom fit in it; the KV cache gets what is left (default "
        "%(default)s; the start-up log prints the plan)",
    )
    gpu_weight_format: str = flag(
        "auto",
        choices=("auto", *GPU_WEIGHT_FORMATS),
        help="weights of the GPU part's linear layers (attention projections, dense MLPs, "
        "shared experts; routers, norms, the embedding table and MLA's absorbed kv_b stay in "
        "--dtype, the head unless --quantize-lm-head): bf16 = unquantized, "
        "in --dtype (float32 on the CPU); fp8 = float8 e4m3 per output channel, run by "
        "torch._scaled_mm on GPUs with FP8 matrix units (compute capability >= 8.9), upcast "
        "per call elsewhere (slow: a reference path); int8 = weight-only, per output channel "
        "(torch's int8 kernel on the CPU; on CUDA a Triton kernel for up to 128 rows, larger "
        "steps dequantize per call); int4 = weight-only, groups of 128 inputs, two per byte "
        "(torch's tinygemm kernels). auto: bf16 where the unquantized GPU part takes at most "
        "half of the memory budget (the checkpoint's own precision), "
        "else fp8 on GPUs with FP8 units (an FP8 checkpoint's 128x128 block scales are "
        "requantized per output channel, a bf16 one is quantized at load), else bf16; the "
        "start-up log says which and why (default %(default)s)",
    )
    quantize_lm_head: bool = flag(
        False,
        help="with --gpu-weight-format fp8|int8|int4, the output head (lm_head) in that format "
        "too; off by default (the input embedding table always stays in --dtype)",
    )
    kv_cache_dtype: str = flag(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="storage of the KV cache: auto (the model's dtype) or fp8 (float8_e4m3fn, 1 byte "
        "per element: twice bfloat16's tokens in the same memory, for a small quality cost; "
        "written with a saturating cast at scale 1.0, read back as the model's dtype) "
        "(default %(default)s)",
    )
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
        "workers do the rest; chosen from the workers' activation counts, chosen again every "
        f"{envs.GPU_EXPERTS_REFRESH_S.name} seconds (default %(default)s)",
    )
    gpu_experts_refresh_s: float = env_field(envs.GPU_EXPERTS_REFRESH_S)
    expert_placement: str | None = flag(
        None,
        metavar="FILE",
        help='JSON {"layer": [expert ids]} naming the experts to keep on the GPU per layer',
    )
    fused_kernels: bool = env_field(envs.FUSED_KERNELS)
    flashmla: bool = env_field(envs.FLASHMLA)
    cuda_graphs: bool = flag(
        True,
        name="--no-cuda-graphs",
        help="run every decode step eagerly (by default, on CUDA, the decode step's GPU "
        "segments between MoE calls are captured once per batch size and replayed as CUDA "
        "graphs)",
    )
    graph_expert_calls: bool = env_field(envs.GRAPH_EXPERT_CALLS)
    chain_decode_steps: bool = env_field(envs.CHAIN_DECODE_STEPS)
    max_deferred_experts_per_token: int = env_field(envs.MAX_DEFERRED_EXPERTS_PER_TOKEN)
    stream_prefill: str = flag(
        "auto",
        choices=STREAM_PREFILL_MODES,
        help="prefill through the GPU: a step's prefill chunk has its routed experts computed on "
        "the GPU from the workers' packed weights, streamed over PCIe layer by layer (the next "
        "layer's copy overlapping this one's compute; two layers' experts on the GPU), while "
        "decode rows of the same step go to the CPU workers. auto: for chunks at least as long "
        "as a cost model measured at start-up says pays off (printed; CUDA only, and only where "
        "the KV cache the memory plan leaves beside streaming holds --kv-cache-tokens or one "
        "full context); on: every chunk; off: never "
        "(default %(default)s). Needs workers on this host that share their packed experts "
        "(ktserve expert --share-experts, the default)",
    )
    cuda_graph_max_batch: int = flag(
        32,
        help="largest decode batch run with CUDA graphs; larger ones run eagerly (default "
        "%(default)s)",
    )
    tensor_parallel_size: int = flag(
        1,
        metavar="N",
        help="split the GPU part over N GPUs of this host (cuda:0..N-1 from --device's index; "
        "on the CPU, N processes joined by gloo): each rank holds 1/N of the attention heads "
        "and of the dense and shared-expert MLPs (embedding, head, norms, routers and MLA's "
        "latent cache stay whole on every rank), partial outputs are summed by all-reduce; "
        "rank 0 (this process) schedules, serves HTTP and makes the one expert call per MoE "
        "layer and step, ranks 1..N-1 are follower processes it starts and stops. N must "
        "divide the attention heads; decode CUDA graphs are off with N > 1 (default "
        "%(default)s)",
    )
    tensor_parallel_timeout_s: float = flag(
        120.0,
        name="--tensor-parallel-timeout",
        metavar="SECONDS",
        help="with --tensor-parallel-size > 1: how long rank 0 waits for a follower to start, "
        "load its share and join a collective before the service fails (a follower that exits "
        "is noticed at once) (default %(default)s)",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    experts: ExpertClientConfig = field(default_factory=ExpertClientConfig)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 16:
            raise ValueError(f"--kv-cache-tokens must be >= 16, got {self.kv_cache_tokens}")
        if self.kv_host_cache_gib < 0:
            raise ValueError(f"--kv-host-cache-gib must be >= 0, got {self.kv_host_cache_gib}")
        if self.kv_host_cache_gib and not self.prefix_caching:
            raise ValueError("--kv-host-cache-gib needs prefix caching (drop --no-prefix-caching)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.quantize_lm_head and self.gpu_weight_format == "bf16":
            raise ValueError("--quantize-lm-head needs --gpu-weight-format fp8, int8 or int4")
        if self.gpu_weight_format not in ("auto", *GPU_WEIGHT_FORMATS):
            raise ValueError(
                f"--gpu-weight-format must be auto or one of {GPU_WEIGHT_FORMATS}, got "
                f"{self.gpu_weight_format!r}"
            )
        if self.gpu_experts < 0:
            raise ValueError(f"--gpu-experts must be >= 0, got {self.gpu_experts}")
        if self.gpu_experts_refresh_s < 0:
            raise ValueError(
                f"{envs.GPU_EXPERTS_REFRESH_S.name} must be >= 0, got {self.gpu_experts_refresh_s}"
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
                f"{envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name} must be >= 0, got "
                f"{self.max_deferred_experts_per_token}"
            )
        if self.max_deferred_experts_per_token and self.experts.num_slots < 3:
            raise ValueError(
                f"{envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name} needs 3 slots per expert channel "
                f"(a deferred call, the next layer's two), got num_slots={self.experts.num_slots}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(
                f"--tensor-parallel-timeout must be positive, got {self.tensor_parallel_timeout_s}"
            )
        if self.tensor_parallel_size > 1 and self.kv_host_cache_gib:
            raise ValueError(
                "--kv-host-cache-gib is not supported with --tensor-parallel-size > 1 yet (the "
                "followers' caches would need the same copies between tiers)"
            )
        if self.tensor_parallel_size > 1 and self.stream_prefill == "on":
            raise ValueError(
                "--stream-prefill on is not supported with --tensor-parallel-size > 1 yet"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError(
                f"--cuda-graph-max-batch must be >= 1, got {self.cuda_graph_max_batch}"
            )

    def with_workers(self, workers: tuple[str, ...], token: str | None = None) -> GPUServiceConfig:
        """This service on the expert workers at these gRPC addresses (calls carry token)."""
        return replace(self, experts=replace(self.experts, workers=workers, token=token))
