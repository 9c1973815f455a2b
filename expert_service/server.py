"""The expert worker's gRPC control plane: a thin servicer, one error interceptor, health."""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import ktshm
from expert_service.placement import bound_node
from expert_service.worker import ExpertWorker, WorkerStateError
from ktserve import checkpoint
from ktserve.names import weight_format_from_pb, weight_format_to_pb
from ktserve.numa import format_cpulist
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import CheckToken

log = logging.getLogger("ktserve.expert")

VERSION = "0.1.0"
SERVICE_NAME = "ktserve.v1.ExpertService"

# Most specific first: the first matching class decides the status code.
STATUS_BY_EXCEPTION: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (checkpoint.InsufficientMemory, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (checkpoint.CheckpointDirNotFound, grpc.StatusCode.NOT_FOUND),
    (ktshm.ChannelNotFound, grpc.StatusCode.NOT_FOUND),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (WorkerStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (ktshm.ChannelBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (checkpoint.CheckpointError, grpc.StatusCode.INVALID_ARGUMENT),
    (ktshm.LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_BY_EXCEPTION:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException) -> str:
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions escaping a servicer into gRPC statuses with the exception's message."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def unary(behavior):
            def wrapped(request, context):
                try:
                    return behavior(request, context)
                except Exception as exc:
                    _abort(context, method, exc)

            return wrapped

        def streaming(behavior):
            def wrapped(request, context):
                try:
                    yield from behavior(request, context)
                except Exception as exc:
                    _abort(context, method, exc)

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        return handler


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    context.abort(code, _message(exc))


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(self, worker: ExpertWorker, health_servicer: health.HealthServicer) -> None:
        self.worker = worker
        self.health = health_servicer

    def GetInfo(self, request, context):
        return worker_info(self.worker)

    def LoadModel(self, request, context):
        if not request.model_dir:
            raise ValueError("model_dir is required")
        experts = None
        if request.HasField("experts"):
            experts = range(request.experts.start, request.experts.stop)
        fmt = weight_format_from_pb(request.format) or self.worker.config.weight_format
        updates: queue.Queue = queue.Queue()

        def load() -> None:
            try:
                self.worker.load(
                    request.model_dir, experts, fmt,
                    progress=lambda done, total, nbytes: updates.put(
                        pb.LoadProgress(layers_done=done, layers_total=total, bytes_done=nbytes)
                    ),
                )  # fmt: skip
                updates.put(None)
            except BaseException as exc:
                updates.put(exc)

        threading.Thread(target=load, name="load-model", daemon=True).start()
        while (item := updates.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
        set_serving(self.health, True)
        yield pb.LoadProgress(done=True, info=worker_info(self.worker))

    def Attach(self, request, context):
        if not request.channel_name:
            raise ValueError("channel_name is required")
        return pb.AttachResponse(epoch=self.worker.attach(request.channel_name))

    def Detach(self, request, context):
        self.worker.detach(request.channel_name)
        return pb.DetachResponse()

    def GetStats(self, request, context):
        self.worker.wait_for_stats()
        m = self.worker.metrics
        phases = m.phase_seconds()
        return pb.WorkerStats(
            calls=m.total("calls"),
            tokens=m.total("tokens"),
            weight_bytes_read=m.total("weight_bytes"),
            errors=int(sum(s.value for metric in m.errors.collect() for s in metric.samples
                           if s.name.endswith("_total"))),
            calls_in_flight=self.worker.in_flight,
            busy_seconds=m.total("busy_seconds"),
            dispatch_seconds=phases[0],
            kernel_seconds=phases[1],
            publish_seconds=phases[2],
            bookkeeping_seconds=phases[3],
            idle_seconds=m.total("idle_seconds"),
            idle_gaps=m.total("idle_gaps"),
            inner_idle_seconds=m.total("inner_idle_seconds"),
            inner_idle_gaps=m.total("inner_idle_gaps"),
            call_timings=_call_timings_pb(self.worker.call_timing_parts()),
            activations=[
                pb.ExpertCount(layer=layer, expert=expert, count=count)
                for layer, expert, count in m.activations.nonzero()
            ],
        )  # fmt: skip

    def Drain(self, request, context):
        set_serving(self.health, False)
        completed = self.worker.drain(request.timeout_seconds or None)
        if request.exit:
            self.worker.exit_requested.set()
        return pb.DrainResponse(calls_completed=completed)


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, status)


def worker_info(worker: ExpertWorker) -> pb.WorkerInfo:
    from ktserve.checkpoint import available_memory_bytes

    info = pb.WorkerInfo(
        version=VERSION,
        isa=worker.kernel.isa,
        num_threads=worker.kernel.num_threads,
        memory_total_bytes=_mem_total(),
        memory_available_bytes=available_memory_bytes()[0],
        state=int(worker.state),
        channels=worker.channel_names(),
        pid=worker.pid,
        cpus=format_cpulist(os.sched_getaffinity(worker.pid)),
        numa_node=bound_node(),
    )
    shard = worker.shard
    if shard is not None:
        info.model_dir = shard.source_dir
        info.model_family = shard.spec.family
        info.format = weight_format_to_pb(shard.weight_format)
        info.experts.start, info.experts.stop = shard.experts.start, shard.experts.stop
        info.num_experts = shard.spec.num_experts
        info.intermediate.start, info.intermediate.stop = shard.rows.start, shard.rows.stop
        info.intermediate_size = shard.spec.moe_intermediate_size
        info.hidden_size = shard.spec.hidden_size
        info.moe_layers.extend(shard.spec.moe_layers)
        info.weight_bytes = shard.nbytes
        if shard.store is not None:
            info.store.CopyFrom(_store_pb(shard.store))
    return info


def _call_timings_pb(parts: dict | None) -> pb.CallTimings | None:
    if parts is None:
        return None
    return pb.CallTimings(**{f"{name}_ns": values.tolist() for name, values in parts.items()})


def _store_pb(store) -> pb.PackedStore:
    return pb.PackedStore(dir=store.dir, layers=[
        pb.StoreLayer(layer=layer, file=entry["file"], tensors=[
            pb.StoreTensor(name=name, dtype=t["dtype"], shape=t["shape"], offset=t["offset"])
            for name, t in sorted(entry["tensors"].items())
        ]) for layer, entry in sorted(store.layers.items())
    ])  # fmt: skip


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def build_server(
    worker: ExpertWorker, listen: str, token: str | None = None
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started-but-not-yet-serving gRPC server bound to `listen`; returns it and its port.
    token: every call but health must carry it (ktserve/worker_token.py)."""
    interceptors = [CheckToken(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpc"),
        interceptors=[*interceptors, ErrorInterceptor()],
    )
    health_servicer = health.HealthServicer()
    set_serving(health_servicer, False)
    pb_grpc.add_ExpertServiceServicer_to_server(ExpertServicer(worker, health_servicer), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"could not listen on {listen}")
    server.start()
    return server, port, health_servicer
