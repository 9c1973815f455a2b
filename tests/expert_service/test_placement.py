"""`ktserve expert --cpus --numa-node`: a real worker process whose every thread runs on the CPUs
given (as /proc says), whose memory policy binds it to the node, and which warns and serves on
where the node cannot be bound."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ktserve.numa import format_cpulist, parse_cpulist
from ktserve.protocol import expert_pb2 as pb
from ktserve.worker_token import TOKEN_ENV, new_token
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401
from tests.support.watched_process import WatchedProcess


def allowed_cpus(pid: int) -> dict[int, tuple[int, ...]]:
    """Each thread of pid: its Cpus_allowed_list, from /proc/PID/task/TID/status."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        found[int(task.name)] = parse_cpulist(re.search(r"Cpus_allowed_list:\s*(\S+)", status)[1])
    return found


def test_a_pinned_worker_runs_every_thread_on_its_cpus_with_its_memory_bound():
    subset = (max(os.sched_getaffinity(0)),)  # one CPU of this machine's
    cpus = format_cpulist(subset)
    print(f"pinning to CPU {cpus} of {format_cpulist(os.sched_getaffinity(0))}")
    token = new_token()
    # NOTE: no --threads: the default follows the CPUs (one here, the kernel's minimum)
    proc = WatchedProcess(
        [sys.executable, "-m", "ktserve", "expert", "--listen", "127.0.0.1:0", "--cpus", cpus,
         "--numa-node", "0"], env={TOKEN_ENV: token},
    )  # fmt: skip
    try:
        line = proc.read_line(r"listening on")
        assert f"1 threads on CPUs {cpus}, memory on node 0" in line, line
        address = re.search(r"listening on (\S+)", line)[1]
        threads = allowed_cpus(proc.proc.pid)
        assert len(threads) > 2  # the kernel's pool, gRPC's
        assert set(threads.values()) == {subset}, threads
        from ktserve.protocol import expert_pb2_grpc as pb_grpc
        from ktserve.worker_auth import worker_channel

        with worker_channel(address, token) as channel:
            info = pb_grpc.ExpertServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
        assert (info.cpus, info.numa_node, info.num_threads) == (cpus, 0, 1)
    finally:
        proc.kill()
        proc.close_streams()


def test_a_node_that_cannot_be_bound_is_a_warning_and_the_worker_serves_on():
    worker = ExpertProcess("--numa-node", "63")  # no such node: set_mempolicy refuses it
    try:
        info = worker.stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        assert info.numa_node == -1
        assert info.cpus == format_cpulist(os.sched_getaffinity(0))
        assert "memory not bound to NUMA node 63 (set_mempolicy: Invalid argument)" in (
            worker.stderr()
        )
    finally:
        worker.close()


def test_cpus_outside_the_allowed_ones_are_refused():
    proc = WatchedProcess([sys.executable, "-m", "ktserve", "expert", "--cpus", "4096"])
    try:
        assert proc.proc.wait(60) == 2
        assert "--cpus 4096: CPUs 4096 are not among those this process may use" in proc.stderr()
    finally:
        proc.close_streams()
