"""The whole server of `ktserve serve`: expert workers, GPU service, HTTP, and their shutdown.

Order of start (each step fails with a clear error before the next one costs time):

    bind the HTTP socket          (a busy port fails before anything loads)
    load the tokenizer            (missing tokenizer files fail before the workers start; a GGUF's
                                  from its metadata, --tokenizer DIR's instead where given)
    start the expert workers      (Supervisor; wait until each one's gRPC health serves), or wait
                                  for the workers named by --expert-address (ExternalWorkers:
                                  until each serves; their shards must cover every expert)
    build the GPU service         (model, KV cache, engine; ktshm channels attached to the workers)
    serve HTTP until SIGINT/SIGTERM
    drain: new requests 503, running ones finish (--shutdown-timeout; then ended: shutdown.py)
    stop: uvicorn -> engine + channels -> workers started here (SIGTERM, they drain)
"""

from __future__ import annotations

import logging
import signal
import socket
import tempfile
from collections.abc import Callable

import uvicorn

from gpu_service.api.admission import Admission
from gpu_service.api.app import create_app
from gpu_service.api.context import ApiContext
from gpu_service.api.reasoning import END, START, choose_reasoning_parser
from gpu_service.api.shutdown import DrainingServer
from gpu_service.api.tokenizer import ServedTokenizer, load_tokenizer
from gpu_service.api.tool_parsers import ToolParser, choose_tool_parser, tool_parser
from gpu_service.api.worker_metrics import worker_registry
from gpu_service.engine.grammar import GrammarCompiler
from gpu_service.serve_config import ChatConfig, ServeConfig
from gpu_service.service import GPUService, build_gpu_service, check_model_fits
from gpu_service.workers.external_workers import ExternalWorkers
from gpu_service.workers.plan import worker_plans
from gpu_service.workers.supervisor import Supervisor, worker_specs
from ktserve.checkpoint import HFConfig
from ktserve.checkpoint.spec import ModelSpec
from ktserve.numa import read_topology
from ktserve.worker_token import new_token, read_token

log = logging.getLogger("ktserve.serve")

GRACEFUL_SHUTDOWN_S = 5.0  # uvicorn's, after DrainingServer.drain: connections left open


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
        tokenizer = load_tokenizer(config.model_dir, config.chat.tokenizer)
        hf = HFConfig.from_checkpoint(config.model_dir)
        spec = ModelSpec.from_hf(hf)
        check_model_fits(config.gpu, spec, hf)
        parser, reasoning = chat_parsers(config.chat, tokenizer, hf)
        workers = _workers(config, spec)
        workers.start(config.workers.worker_start_timeout_s)
        grammars = GrammarCompiler(
            tokenizer.tokenizer,
            vocab_size=hf.int("vocab_size", len(tokenizer.tokenizer)),
            eos_token_ids=tokenizer.eos_token_ids,
            cache_size=config.chat.grammar_cache_size,
        )
        try:
            grammars.prepare()
        except Exception as exc:  # noqa: BLE001 - llguidance refuses some tokenizers
            log.warning("constrained decoding is off (tool_choice required/named and "
                        "response_format are refused): %s", exc)  # fmt: skip
            grammars = None
        log.info("loading the model's GPU part (family %s)", hf.model_type)
        service = build_gpu_service(
            config.gpu.with_workers(workers.addresses, workers.token),
            eos_token_ids=tokenizer.eos_token_ids,
            decode=tokenizer.decode,
            hf=hf,
        )
        worker_status = _worker_status(workers, service)
        http = config.http
        max_in_flight = service.config.scheduler.max_num_seqs + http.max_waiting_requests
        ctx = ApiContext(
            engine=service.engine,
            tokenizer=tokenizer,
            model_name=config.model_name,
            max_model_len=service.max_model_len,
            worker_status=worker_status,
            api_key=http.api_key,
            registries=(service.metrics.registry, worker_registry(worker_status)),
            request_timeout_s=http.request_timeout_s,
            max_request_bytes=http.max_request_bytes,
            request_read_timeout_s=http.request_read_timeout_s,
            metrics_public=http.metrics_public,
            admission=Admission(
                max_in_flight, service.config.scheduler.max_num_seqs, service.engine.mean_run_s
            ),
            tool_parser=parser,
            reasoning_parser=reasoning,
            grammars=grammars,
            access_log=http.access_log,
            max_stored_responses=http.max_stored_responses,
        )
        server = DrainingServer(
            uvicorn.Config(
                create_app(ctx),
                log_level="info",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ),
            ctx,
            http.shutdown_timeout_s,
        )
        leader = service.tensor_parallel
        if leader is not None:  # NOTE: a follower gone: every step would fail, so stop serving
            leader.on_failure = lambda failure: setattr(server, "should_exit", True)
        on_ready(url_of(sock), config)
        server.run(sockets=[sock])
        if leader is not None and leader.failure is not None:
            log.error("stopped serving: %s", leader.failure)
            return 1
        return 0 if server.started else 1
    finally:
        _ignore_signals()
        if service is not None:
            service.close()
        if workers is not None:
            workers.stop()
        sock.close()
        log.info("stopped")


def chat_parsers(
    chat: ChatConfig, tokenizer: ServedTokenizer, hf: HFConfig
) -> tuple[ToolParser | None, str | None]:
    """The tool-call parser and the reasoning parser's name: as the flags say, or as the
    checkpoint's template and family suggest. Their markers are decoded as text."""
    template = tokenizer.tokenizer.chat_template
    template = template if isinstance(template, str) else str(template or "")
    model_type = hf.model_type
    tool_name = chat.tool_call_parser or choose_tool_parser(template, model_type)
    reasoning = chat.reasoning_parser or choose_reasoning_parser(template, model_type)
    parser = tool_parser(tool_name) if tool_name not in (None, "none") else None
    reasoning = reasoning if reasoning != "none" else None
    log.info("tool-call parser: %s, reasoning parser: %s", tool_name, reasoning)
    tokenizer.keep_tokens([*(parser.markers if parser else ()), START, END])
    return parser, reasoning


def _workers(config: ServeConfig, spec: ModelSpec) -> Supervisor | ExternalWorkers:
    workers = config.workers
    if workers.expert_addresses is not None:
        log.info("connecting to expert workers at %s", ", ".join(workers.expert_addresses))
        return ExternalWorkers(
            workers.expert_addresses, spec, read_token(workers.worker_token_file)
        )
    plans = worker_plans(workers, spec, read_topology())
    log.info(
        "starting %d expert worker(s) (%s, %s)",
        len(plans),
        "; ".join(plan.label for plan in plans),
        workers.weight_format,
    )
    # NOTE: mkdtemp makes the directory 0700: no other user reaches the workers' sockets
    socket_dir = tempfile.mkdtemp(prefix="ktserve-workers-")
    specs = worker_specs(config.model_dir, plans, workers.weight_format, workers.threads,
                         socket_dir)  # fmt: skip
    return Supervisor(specs, restart=workers.restart_workers, token=new_token(),
                      socket_dir=socket_dir, model=spec)  # fmt: skip


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
