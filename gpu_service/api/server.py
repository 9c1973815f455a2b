"""The whole server of `ktserve serve`: expert workers, GPU service, HTTP, and their shutdown.

Order of start (each step fails with a clear error before the next one costs time):

    bind the HTTP socket          (a busy port fails before anything loads)
    load the tokenizer            (missing tokenizer files fail before the workers start)
    start the expert workers      (Supervisor; wait until each one's gRPC health serves), or wait
                                  for the workers named by --expert-address (ExternalWorkers:
                                  until each serves; their shards must cover every expert)
    build the GPU service         (model, KV cache, engine; ktshm channels attached to the workers)
    serve HTTP until SIGINT/SIGTERM
    stop: uvicorn -> engine + channels -> workers started here (SIGTERM, they drain)
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable

import uvicorn

from gpu_service.api.app import create_app
from gpu_service.api.context import ApiContext
from gpu_service.api.tokenizer import load_tokenizer
from gpu_service.api.worker_metrics import worker_registry
from gpu_service.external_workers import ExternalWorkers
from gpu_service.serve_config import ServeConfig
from gpu_service.service import GPUService, build_gpu_service, check_model_fits
from gpu_service.supervisor import Supervisor, worker_specs
from ktserve.checkpoint.spec import ModelSpec

log = logging.getLogger("ktserve.serve")

GRACEFUL_SHUTDOWN_S = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: ServeConfig, on_ready: Callable[[str, ServeConfig], None]) -> int:
    """Run until SIGINT/SIGTERM; every process and shared-memory segment is gone on return."""
    sock = bind_socket(config.http.host, config.http.port)
    workers: Supervisor | ExternalWorkers | None = None
    service: GPUService | None = None
    try:
        tokenizer = load_tokenizer(config.model_dir)
        spec = ModelSpec.from_config_dir(config.model_dir)
        check_model_fits(config.gpu, spec)
        workers = _workers(config, spec)
        workers.start(config.workers.worker_start_timeout_s)
        log.info("loading the model's GPU part")
        service = build_gpu_service(
            config.gpu.with_workers(workers.addresses),
            eos_token_ids=tokenizer.eos_token_ids,
            decode=tokenizer.decode,
        )
        worker_status = _worker_status(workers, service)
        ctx = ApiContext(
            engine=service.engine,
            tokenizer=tokenizer,
            model_name=config.model_name,
            max_model_len=service.max_model_len,
            worker_status=worker_status,
            api_key=config.http.api_key,
            registries=(service.metrics.registry, worker_registry(worker_status)),
        )
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(ctx),
                log_level="info",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            )
        )
        on_ready(url_of(sock), config)
        server.run(sockets=[sock])
        return 0 if server.started else 1
    finally:
        _ignore_signals()
        if service is not None:
            service.close()
        if workers is not None:
            workers.stop()
        sock.close()
        log.info("stopped")


def _workers(config: ServeConfig, spec: ModelSpec) -> Supervisor | ExternalWorkers:
    workers = config.workers
    if workers.expert_addresses is not None:
        log.info("connecting to expert workers at %s", ", ".join(workers.expert_addresses))
        return ExternalWorkers(workers.expert_addresses, spec)
    ranges = workers.expert_ranges(spec.num_experts)
    log.info(
        "starting %d expert worker(s) (experts %s, %s)",
        len(ranges),
        ", ".join(ranges),
        workers.weight_format,
    )
    return Supervisor(
        worker_specs(config.model_dir, ranges, workers.weight_format, workers.threads),
        restart=workers.restart_workers,
    )


def _worker_status(
    workers: Supervisor | ExternalWorkers, service: GPUService
) -> Callable[[], list[dict]]:
    """Each worker: its state (serving = alive) and whether its channel's peer beats (a
    restarted worker is re-attached at the next MoE call)."""

    def status() -> list[dict]:
        attached = service.experts.alive()
        rows = workers.status()
        for row in rows:
            row["attached"] = attached.get(row["address"], False)
            row["alive"] = row["state"] == "serving"
        return rows

    return status


def _ignore_signals() -> None:
    def note(signum: int, frame: object) -> None:
        log.info("%s: already stopping", signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)
