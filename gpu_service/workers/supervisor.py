"""Expert workers as supervised subprocesses of `ktserve serve`.

Each worker is `python -m ktserve expert --model M --listen unix:DIR/worker-I.sock ...` (or a
loopback port, where a worker takes calls only with the token) at an address fixed for its life,
so a restarted worker answers at the same address and the GPU side's ShmExperts re-attaches to
it by itself. Per worker:

    STARTING --its grpc.health.v1 says SERVING--> SERVING --exits--> EXITED
        ^                                                              | restart_workers
        +--------------------- respawned (after a backoff) ------------+

A worker is ready only when its health service says so (it does once its experts are loaded):
a thread per spawn asks its grpc.health.v1 Check every POLL_S until it says SERVING or the
process exits. Workers' stdout is only echoed, line by line with a "[expert i]" prefix; their
stderr (load progress bars) goes straight to this process's stderr. Workers run in their own
process group, so a Ctrl+C in the terminal reaches only the server, which then SIGTERMs them
(they drain); on Linux they also get SIGTERM should the server die without stopping them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_service.experts.moe_client import RECONNECT_OPTIONS
from gpu_service.workers.child_processes import wait_or_kill
from gpu_service.workers.shard_coverage import WorkerShard, check_coverage
from ktserve import shared_store
from ktserve.parent_process import with_parent
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import worker_channel
from ktserve.worker_token import TOKEN_ENV, TOKEN_FILE_ENV

if TYPE_CHECKING:
    from gpu_service.workers.plan import WorkerPlan
    from ktserve.checkpoint.spec import ModelSpec

log = logging.getLogger("ktserve.supervisor")

# The worker's health says SERVING for this service (and for "") once its experts are loaded.
HEALTH_SERVICE = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name
POLL_S = 0.1
HEALTH_TIMEOUT_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that lived this long restarts without delay


class WorkerStartError(RuntimeError):
    """An expert worker exited or did not load in time."""


@dataclass(frozen=True)
class WorkerSpec:
    """One expert worker: its gRPC address and the command line that runs it."""

    index: int
    address: str
    experts: str
    argv: tuple[str, ...]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_specs(
    model_dir: str,
    plans: Sequence[WorkerPlan],
    weight_format: str,
    threads: int | None,
    socket_dir: str | None = None,
) -> list[WorkerSpec]:
    """plans: what each worker holds and where it runs (workers/plan.py).
    socket_dir: the workers listen on Unix sockets there (a 0700 directory: no other user
    reaches them); None: on free loopback ports (then the Supervisor needs a token)."""
    specs = []
    for i, plan in enumerate(plans):
        if socket_dir is not None:
            address = f"unix:{socket_dir}/worker-{i}.sock"
        else:
            address = f"127.0.0.1:{free_port()}"
        argv = [
            sys.executable,
            "-m",
            "ktserve",
            "expert",
            "--model",
            model_dir,
            "--listen",
            address,
            "--experts",
            plan.experts,
            "--format",
            weight_format,
        ]
        if plan.intermediate_rows is not None:
            argv += ["--intermediate-rows", plan.intermediate_rows]
        if plan.cpus is not None:
            argv += ["--cpus", plan.cpus]
        if plan.numa_node is not None:
            argv += ["--numa-node", str(plan.numa_node)]
        if threads is not None:
            argv += ["--threads", str(threads)]
        label = plan.experts
        if plan.intermediate_rows is not None:
            label += f" rows {plan.intermediate_rows}"
        specs.append(WorkerSpec(i, address, label, tuple(argv)))
    return specs


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen | None = None
    state: str = "starting"
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    restart_at: float = 0.0
    serving: threading.Event = field(default_factory=threading.Event)


class Supervisor:
    """Starts the workers, waits until they serve, restarts those that exit, stops them all."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        restart: bool = True,
        drain_timeout_s: float = 35.0,
        token: str | None = None,
        socket_dir: str | None = None,
        model: ModelSpec | None = None,
    ) -> None:
        """token: the workers' control-plane token, given to them in their environment.
        socket_dir: removed by stop() (worker_specs put the workers' sockets there).
        model: once serving, the workers' shards must hold its experts exactly once (GetInfo)."""
        self.workers = [_Worker(spec) for spec in specs]
        self.model = model
        self.token = token
        self.socket_dir = socket_dir
        self._env = None
        if token is not None:
            env = {k: v for k, v in os.environ.items() if k != TOKEN_FILE_ENV}
            self._env = {**env, TOKEN_ENV: token}
        self.restart = restart
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        # NOTE: Popen vforks where it can (with_parent: no preexec_fn); where it falls back to
        # fork(), a thread inside a gRPC call across it makes gRPC skip its fork handlers and the
        # child can abort, so spawns and health checks still take turns.
        self._fork_lock = threading.Lock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(w.spec.address for w in self.workers)

    def start(self, timeout_s: float) -> None:
        """Spawn every worker and return once all serve; WorkerStartError otherwise."""
        # NOTE: every worker is forked before the first health check opens a gRPC channel: a
        # fork while gRPC's own threads run could leave a child stuck before it execs.
        for worker in self.workers:
            self._spawn(worker, watch_health=False)
        for worker in self.workers:
            self._watch_health(worker, worker.proc)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not worker.serving.wait(POLL_S):
                code = worker.proc.poll()
                if code is not None:
                    raise WorkerStartError(
                        f"expert worker {worker.spec.index} (experts {worker.spec.experts}) "
                        f"exited with code {code} while loading; its messages are above"
                    )
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"expert worker {worker.spec.index} did not load in {timeout_s:.0f} s"
                    )
        if self.model is not None:
            check_coverage([self._shard(w.spec.address) for w in self.workers], self.model)
        self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._monitor.start()

    def status(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "index": w.spec.index,
                    "address": w.spec.address,
                    "experts": w.spec.experts,
                    "state": w.state,
                    "pid": w.proc.pid if w.proc else None,
                    "restarts": w.restarts,
                    "exit_code": w.exit_code,
                }
                for w in self.workers
            ]

    def stop(self) -> None:
        """SIGTERM every worker (they answer their calls in flight), then wait; kill laggards."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        with self._lock:
            procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        wait_or_kill(procs, self.drain_timeout_s, "expert worker")
        shared_store.cleanup_stale()  # NOTE: the packed stores of workers that did not exit
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals
    def _shard(self, address: str) -> WorkerShard:
        with self._fork_lock:
            channel = worker_channel(address, self.token)
            try:
                stub = pb_grpc.ExpertServiceStub(channel)
                info = stub.GetInfo(pb.GetInfoRequest(), timeout=HEALTH_TIMEOUT_S * 10)
            finally:
                channel.close()
        return WorkerShard.from_info(address, info)

    def _spawn(self, worker: _Worker, watch_health: bool = True) -> None:
        worker.serving.clear()
        with self._fork_lock:
            proc = subprocess.Popen(
                worker.spec.argv,
                env=with_parent(self._env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=None,
                text=True,
                bufsize=1,
                process_group=0,
            )
        with self._lock:
            worker.proc = proc
            worker.state = "starting"
            worker.exit_code = None
            worker.started_at = time.monotonic()
        log.info(
            "expert worker %d (experts %s) started: pid %d, %s",
            worker.spec.index,
            worker.spec.experts,
            proc.pid,
            worker.spec.address,
        )
        threading.Thread(
            target=self._pump,
            args=(worker, proc),
            daemon=True,
            name=f"expert-{worker.spec.index}-stdout",
        ).start()
        if watch_health:
            self._watch_health(worker, proc)

    def _watch_health(self, worker: _Worker, proc: subprocess.Popen) -> None:
        threading.Thread(
            target=self._await_serving,
            args=(worker, proc),
            daemon=True,
            name=f"expert-{worker.spec.index}-health",
        ).start()

    def _pump(self, worker: _Worker, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            print(f"[expert {worker.spec.index}] {line}", end="", flush=True)
        proc.stdout.close()

    def _await_serving(self, worker: _Worker, proc: subprocess.Popen) -> None:
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        with self._fork_lock:
            channel = grpc.insecure_channel(worker.spec.address, options=RECONNECT_OPTIONS)
        try:
            check = health_pb2_grpc.HealthStub(channel).Check
            while proc.poll() is None and not self._stopping.is_set():
                with self._fork_lock:
                    try:
                        status = check(request, timeout=HEALTH_TIMEOUT_S).status
                    except grpc.RpcError:  # not listening yet
                        status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    with self._lock:
                        if worker.proc is not proc or worker.state != "starting":
                            return  # NOTE: replaced or exited meanwhile: only STARTING serves
                        worker.state = "serving"
                    worker.serving.set()
                    return
                self._stopping.wait(POLL_S)
        finally:
            with self._fork_lock:
                channel.close()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            for worker in self.workers:
                self._check(worker)

    def _check(self, worker: _Worker) -> None:
        now = time.monotonic()
        if worker.state == "restarting":
            if now >= worker.restart_at:
                worker.restarts += 1
                self._spawn(worker)
            return
        code = worker.proc.poll()
        if code is None or worker.state == "exited":
            return
        with self._lock:
            worker.exit_code = code
            worker.state = "restarting" if self.restart else "exited"
        if not self.restart:
            log.error(
                "expert worker %d (pid %d) exited with code %s; not restarting it "
                "(--no-restart-workers)",
                worker.spec.index,
                worker.proc.pid,
                code,
            )
            return
        lived = now - worker.started_at
        delay = 0.0 if lived > STABLE_S else min(2.0**worker.restarts, MAX_BACKOFF_S) * 0.5
        worker.restart_at = now + delay
        log.warning(
            "expert worker %d (pid %d) exited with code %s; restarting it in %.1f s",
            worker.spec.index,
            worker.proc.pid,
            code,
            delay,
        )
