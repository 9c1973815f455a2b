"""`ktserve serve`'s configuration; its flags map one-to-one onto ServeConfig's fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpu_service.config import (
    MODEL_DTYPES,
    ExpertClientConfig,
    GPUServiceConfig,
    SchedulerConfig,
)
from ktserve.checkpoint import parse_expert_range
from ktserve.names import WEIGHT_FORMATS
from ktserve.wire import X_DTYPES as WIRE_DTYPES

API_KEY_ENV = "KTSERVE_API_KEY"
DEVICE_ENV = "KTSERVE_DEVICE"


@dataclass(frozen=True)
class ServeConfig:
    """model_dir: Hugging Face checkpoint with tokenizer files. host/port: where the HTTP API
    listens (port 0 picks a free one). api_key: required as `Authorization: Bearer ...` on /v1/*
    when set. served_model_name: the `model` clients send (default: model_dir's name).
    expert_workers: CPU worker processes; experts_per_worker: their expert id ranges ("0-63"), by
    default an even split; weight_format and threads apply to each worker. gpu_experts: hot
    routed experts per MoE layer kept on the GPU (chosen from the workers' activation counts, or
    listed per layer in the JSON file expert_placement), re-chosen from live routing every
    gpu_experts_refresh_s seconds (0: never). restart_workers: restart a worker
    that exits; worker_timeout_s: how long requests wait for a dead worker before failing (503);
    worker_start_timeout_s: how long a worker may take to load. expert_addresses: gRPC addresses
    ("HOST:PORT") of workers that run on their own (`ktserve expert`); when set, none are
    started here and the worker flags above do not apply. cuda_graphs: replay the decode
    step's GPU segments as CUDA graphs (CUDA only) for batches up to cuda_graph_max_batch.
    The rest is GPUServiceConfig's.
    """

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    expert_workers: int = 1
    experts_per_worker: tuple[str, ...] | None = None
    weight_format: str = "int8"
    threads: int | None = None
    gpu_experts: int = 0
    gpu_experts_refresh_s: float = 300.0
    expert_placement: str | None = None
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    dtype: str = "auto"
    wire_dtype: str = "bfloat16"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    device: str | None = None
    worker_timeout_s: float = 30.0
    restart_workers: bool = True
    worker_start_timeout_s: float = 3600.0
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 32
    expert_addresses: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
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
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.gpu_experts < 0:
            raise ValueError(f"--gpu-experts must be >= 0, got {self.gpu_experts}")
        if self.gpu_experts_refresh_s < 0:
            raise ValueError(
                f"--gpu-experts-refresh must be >= 0, got {self.gpu_experts_refresh_s}"
            )
        if self.expert_placement is not None and not Path(self.expert_placement).is_file():
            raise ValueError(f"--expert-placement {self.expert_placement!r} is not a file")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--wire-dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 16:
            raise ValueError(f"--kv-cache-tokens must be >= 16, got {self.kv_cache_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.cuda_graph_max_batch < 1:
            raise ValueError(
                f"--cuda-graph-max-batch must be >= 1, got {self.cuda_graph_max_batch}"
            )
        if self.worker_timeout_s <= 0 or self.worker_start_timeout_s <= 0:
            raise ValueError("--worker-timeout and --worker-start-timeout must be positive")
        if self.expert_addresses is not None:
            check_addresses(self.expert_addresses)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

    def expert_ranges(self, num_experts: int) -> tuple[str, ...]:
        """Each worker's expert ids ("first-last"): as given, or an even split of num_experts."""
        if self.experts_per_worker is not None:
            return self.experts_per_worker
        return split_experts(num_experts, self.expert_workers)

    def gpu_service_config(self, workers: tuple[str, ...]) -> GPUServiceConfig:
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        experts = ExpertClientConfig(
            workers, wire_dtype=self.wire_dtype, worker_timeout_s=self.worker_timeout_s
        )
        return GPUServiceConfig(
            model_dir=self.model_dir,
            device=self.device,
            dtype=self.dtype,
            kv_cache_tokens=self.kv_cache_tokens,
            gpu_experts=self.gpu_experts,
            gpu_experts_refresh_s=self.gpu_experts_refresh_s,
            expert_placement=self.expert_placement,
            cuda_graphs=self.cuda_graphs,
            cuda_graph_max_batch=self.cuda_graph_max_batch,
            scheduler=scheduler,
            experts=experts,
        )


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


def split_experts(num_experts: int, num_workers: int) -> tuple[str, ...]:
    """Contiguous, even ranges ("first-last", inclusive); the first ones take the remainder."""
    if num_workers > num_experts:
        raise ValueError(
            f"{num_workers} expert workers for {num_experts} routed experts: use at most "
            f"{num_experts} workers"
        )
    base, extra = divmod(num_experts, num_workers)
    ranges, start = [], 0
    for i in range(num_workers):
        size = base + (i < extra)
        ranges.append(f"{start}-{start + size - 1}")
        start += size
    return tuple(ranges)
