"""Expert workers that run on their own (`ktserve serve --expert-address`): started by hand, by
compose or by any other supervisor, and reached at fixed gRPC addresses.

`start` waits until every worker answers GetInfo with a loaded model, then checks that their
shards are of this model and hold every routed expert exactly once (partial sums of two workers
holding the same expert would count it twice). While serving, a thread asks each worker for
GetInfo once a second, for /health and the ktserve_worker_up metric. A worker that dies is
waited for by the GPU side's channels (re-attached when it answers at the same address again,
up to --worker-timeout); restarting it is up to whoever started it.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from gpu_service.experts.moe_client import RECONNECT_OPTIONS
from gpu_service.workers.shard_coverage import (  # noqa: F401 - ExpertCoverageError: re-exported
    ExpertCoverageError,
    WorkerShard,
    check_coverage,
)
from gpu_service.workers.supervisor import WorkerStartError
from ktserve.checkpoint.spec import ModelSpec
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import worker_channel

log = logging.getLogger("ktserve.workers")

POLL_S = 1.0
STATES = {
    pb.WORKER_STATE_EMPTY: "empty",
    pb.WORKER_STATE_LOADING: "loading",
    pb.WORKER_STATE_SERVING: "serving",
    pb.WORKER_STATE_DRAINING: "draining",
}
UNREACHABLE = "unreachable"


class _Remote:
    def __init__(self, index: int, address: str, token: str | None = None) -> None:
        self.index = index
        self.address = address
        self.grpc_channel = worker_channel(address, token, RECONNECT_OPTIONS)
        self.stub = pb_grpc.ExpertServiceStub(self.grpc_channel)
        self.state = UNREACHABLE
        self.pid: int | None = None
        self.experts = ""
        self.detail = ""

    def poll(self, timeout_s: float) -> pb.WorkerInfo | None:
        try:
            info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise WorkerStartError(
                    f"expert worker {self.address} refused the call: {exc.details()}; give this "
                    "server the worker's token (--worker-token-file, KTSERVE_WORKER_TOKEN_FILE "
                    "or KTSERVE_WORKER_TOKEN)"
                ) from None
            self.state, self.detail = UNREACHABLE, f"{exc.code().name}: {exc.details()}"
            return None
        self.state = STATES.get(info.state, "unknown")
        self.pid = info.pid
        if info.state == pb.WORKER_STATE_SERVING:
            self.experts = WorkerShard.from_info(self.address, info).label
        return info


class ExternalWorkers:
    """Same interface as Supervisor (start, addresses, status, stop) for workers run elsewhere."""

    def __init__(self, addresses: tuple[str, ...], spec: ModelSpec,
                 token: str | None = None) -> None:  # fmt: skip
        """token: the workers' control-plane token (ktserve/worker_token.py), sent on every call."""
        self.spec = spec
        self.token = token
        self.workers = [_Remote(i, address, token) for i, address in enumerate(addresses)]
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(w.address for w in self.workers)

    def start(self, timeout_s: float) -> None:
        """Wait until every worker serves a model, then check their shards (see module doc)."""
        deadline = time.monotonic() + timeout_s
        shards = [self._wait_serving(w, deadline, timeout_s) for w in self.workers]
        check_coverage(shards, self.spec)
        log.info(
            "expert workers: %s", ", ".join(f"{s.address} (experts {s.label})" for s in shards)
        )
        self._monitor = threading.Thread(target=self._watch, name="expert-workers", daemon=True)
        self._monitor.start()

    def status(self) -> list[dict]:
        return [
            {
                "index": w.index,
                "address": w.address,
                "experts": w.experts,
                "state": w.state,
                "pid": w.pid,
            }
            for w in self.workers
        ]

    def stop(self) -> None:
        """Stop watching and close the gRPC connections; the workers keep running."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        for worker in self.workers:
            worker.grpc_channel.close()

    def _wait_serving(self, worker: _Remote, deadline: float, timeout_s: float) -> WorkerShard:
        last_state = None
        while True:
            info = worker.poll(timeout_s=max(min(deadline - time.monotonic(), POLL_S), 0.1))
            if info is not None and info.state == pb.WORKER_STATE_SERVING:
                return WorkerShard.from_info(worker.address, info)
            if info is not None and info.state == pb.WORKER_STATE_EMPTY:
                raise WorkerStartError(
                    f"expert worker {worker.address} has no model loaded; start it with "
                    "`ktserve expert --model DIR --experts RANGE ...`"
                )
            if worker.state != last_state:
                last_state = worker.state
                log.info("waiting for expert worker %s (%s)", worker.address, worker.state)
            if time.monotonic() >= deadline:
                raise WorkerStartError(
                    f"expert worker {worker.address} was not serving within {timeout_s:g} s "
                    f"(--worker-start-timeout); last state: {worker.state}"
                    + (f" ({worker.detail})" if worker.state == UNREACHABLE else "")
                )
            time.sleep(POLL_S / 10)  # NOTE: polling a remote process; nothing to wait on here

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            for worker in self.workers:
                before = worker.state
                worker.poll(timeout_s=POLL_S)
                if worker.state != before:
                    level = logging.INFO if worker.state == "serving" else logging.WARNING
                    log.log(level, "expert worker %s: %s", worker.address, worker.state)
