"""The supervisor's readiness: a worker serves when its grpc.health.v1 says SERVING, whatever it
prints. Fake workers (a health server and nothing else) stand in for `ktserve expert`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_service.workers.supervisor import (
    HEALTH_SERVICE,
    Supervisor,
    WorkerSpec,
    WorkerStartError,
    free_port,
)

# argv: ADDRESS. Health NOT_SERVING at once, SERVING on SIGUSR1; prints the line the supervisor
# once took for readiness.
FAKE_WORKER = f"""
import signal, sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
servicer = health.HealthServicer()
for name in ("", {HEALTH_SERVICE!r}):
    servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(sys.argv[1])
server.start()
def serve(*_):
    for name in ("", {HEALTH_SERVICE!r}):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
signal.signal(signal.SIGUSR1, serve)
print("ktserve expert: serving experts 0-1 (fake)", flush=True)
while True:
    signal.pause()
"""


def fake_supervisor() -> Supervisor:
    address = f"127.0.0.1:{free_port()}"
    argv = (sys.executable, "-c", FAKE_WORKER, address)
    return Supervisor([WorkerSpec(0, address, "0-1", argv)], restart=False, drain_timeout_s=10)


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_worker_is_ready_when_its_health_serves_not_when_it_prints_so(capsys):
    """While start() waits (on this thread: the workers' PDEATHSIG follows the spawning thread),
    a helper sees the worker's line echoed, checks the worker is not yet taken for ready, then
    lets its health say SERVING; only then does start() return."""
    supervisor = fake_supervisor()
    seen: dict[str, object] = {"echoed": ""}

    def release_once_echoed() -> None:
        deadline = time.monotonic() + 60
        while "[expert 0] ktserve expert: serving" not in seen["echoed"]:
            if time.monotonic() > deadline:
                return  # start() times out and the test fails on it
            seen["echoed"] += capsys.readouterr().out
            supervisor.workers[0].serving.wait(0.05)
        # NOTE: the fake prints its line after its health server listens, NOT_SERVING.
        seen["health"] = health_status(supervisor.addresses[0])
        [row] = supervisor.status()
        seen["state"], seen["ready"] = row["state"], supervisor.workers[0].serving.is_set()
        os.kill(row["pid"], signal.SIGUSR1)

    helper = threading.Thread(target=release_once_echoed, daemon=True)
    helper.start()
    try:
        supervisor.start(timeout_s=60)
        helper.join(60)
        assert not helper.is_alive()
        assert seen["health"] == health_pb2.HealthCheckResponse.NOT_SERVING, seen
        assert seen["state"] == "starting" and seen["ready"] is False, seen
        [row] = supervisor.status()
        assert row["state"] == "serving"
        assert health_status(supervisor.addresses[0]) == health_pb2.HealthCheckResponse.SERVING
    finally:
        supervisor.stop()
    assert supervisor.workers[0].proc.poll() == -signal.SIGTERM


def test_worker_whose_health_never_serves_times_out():
    supervisor = fake_supervisor()
    try:
        with pytest.raises(WorkerStartError, match="expert worker 0 did not load in 2 s"):
            supervisor.start(timeout_s=2)
        [row] = supervisor.status()
        assert row["state"] == "starting"
    finally:
        supervisor.stop()
    assert supervisor.workers[0].proc.poll() == -signal.SIGTERM
