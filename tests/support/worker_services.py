"""A GPU service in this process on real `ktserve expert` workers, as the e2e tests build it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from gpu_service.config import ExpertClientConfig, GPUServiceConfig, SchedulerConfig
from gpu_service.service import GPUService, build_gpu_service
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess

# The GPU part's device: cpu here and in CI; KTSERVE_TEST_DEVICE=cuda on the GPU host.
DEVICE = os.environ.get("KTSERVE_TEST_DEVICE", "cpu")


def worker_service(
    path,
    *workers: ExpertProcess,
    wire_dtype: str = "float32",
    max_model_len: int = 128,
    worker_timeout_s: float = 20,
    **config,
) -> GPUService:
    """build_gpu_service on the checkpoint at `path`, its experts on `workers` (one token for
    all: the first worker's); float32 on the wire, a 128-token context, DEVICE and prefill on
    the workers (--stream-prefill off) unless told."""
    addresses = tuple(w.address for w in workers)
    experts = ExpertClientConfig(addresses, token=workers[0].token, wire_dtype=wire_dtype,
                                 worker_timeout_s=worker_timeout_s)  # fmt: skip
    config.setdefault("device", DEVICE)
    # NOTE: the e2e tests check the workers' path (streaming's own tests ask for it): on CUDA
    # the default, auto, would stream their prompts
    config.setdefault("stream_prefill", "off")
    return build_gpu_service(GPUServiceConfig(
        model_dir=str(path), scheduler=SchedulerConfig(max_model_len=max_model_len),
        experts=experts, **config,
    ))  # fmt: skip


@contextlib.contextmanager
def tiny_served(tmp_path, seed: int, family: str = "qwen3_moe", **config) -> Iterator[GPUService]:
    """worker_service on a tiny `family` checkpoint (written under tmp_path) and one bf16 worker
    of its own, both closed on the way out."""
    path = make_tiny_checkpoint(family, tmp_path / "ckpt", seed=seed)
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    try:
        service = worker_service(path, worker, **config)
        try:
            yield service
        finally:
            service.close()
    finally:
        worker.close()
