"""`ktserve expert` as a real subprocess, and a client for it, for tests of several processes."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ktshm
from ktserve import shared_store, wire
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import worker_channel
from ktserve.worker_token import TOKEN_ENV, TOKEN_FILE_ENV, new_token
from tests.support.watched_process import WatchedProcess

FORMAT_PB = {"bf16": pb.WEIGHT_FORMAT_BF16, "int8": pb.WEIGHT_FORMAT_INT8,
             "int4": pb.WEIGHT_FORMAT_INT4}  # fmt: skip


class ExpertProcess(WatchedProcess):
    """`python -m ktserve expert ...` on a free port; stdout read with deadlines. It takes calls
    only with `token` (fresh unless `env` sets KTSERVE_WORKER_TOKEN or _FILE), which `stub` sends;
    clients of the GPU side pass `worker.token` on."""

    what = "the expert process"

    def __init__(self, *args: str, env: dict[str, str] | None = None, wait_serving: bool = True):
        cmd = [sys.executable, "-m", "ktserve", "expert", "--listen", "127.0.0.1:0",
               "--threads", "1", *args]  # fmt: skip
        env = dict(env or {})
        if TOKEN_FILE_ENV not in env:
            env.setdefault(TOKEN_ENV, new_token())
        self.token = env.get(TOKEN_ENV)
        super().__init__(cmd, env)
        self.grpc_channel = None
        try:
            line = self.read_line(r"listening on (\S+)")
            self.address = re.search(r"listening on (\S+)", line).group(1)
            self.grpc_channel = worker_channel(self.address, self.token)
            self.stub = pb_grpc.ExpertServiceStub(self.grpc_channel)
            if wait_serving and "--model" in args:
                self.read_line(r"serving")
        except BaseException:
            self.close()  # NOTE: the caller never gets this object: leave no process behind
            raise

    def attach(self, channel: ktshm.Channel) -> int:
        return self.stub.Attach(pb.AttachRequest(channel_name=channel.name), timeout=30).epoch

    def close(self) -> None:
        if self.grpc_channel is not None:
            self.grpc_channel.close()
        self.kill()
        self.close_streams()
        # NOTE: killed, it could not remove its packed store; the next worker would
        shared_store.cleanup_stale()


def moe_call(channel: ktshm.Channel, layer: int, x: np.ndarray, ids: np.ndarray,
             weights: np.ndarray, timeout: float = 30.0) -> np.ndarray:  # fmt: skip
    """One MoE call through the channel; returns y [T, H] float32 (a copy)."""
    return channel.call(
        wire.KIND_MOE, layer,
        [np.ascontiguousarray(x, np.float32), np.ascontiguousarray(ids, np.int32),
         np.ascontiguousarray(weights, np.float32)],
        num_tokens=x.shape[0], timeout=timeout,
    )[0]  # fmt: skip


# This run's names (conftest tags them; the processes the tests start inherit the tag).
RUN_PREFIX = ktshm.name_prefix()


def shm_entries() -> set[str]:
    """This run's ktshm entries in /dev/shm: channel segments and their semaphores
    (sem.<name>.req, .rep), none of another process's that was not started by this run."""
    shm = Path("/dev/shm")
    return {p.name for prefix in (RUN_PREFIX, f"sem.{RUN_PREFIX}") for p in shm.glob(f"{prefix}*")}


@contextlib.contextmanager
def no_new_segments() -> Iterator[None]:
    """Fails if the block leaves an entry of this run in /dev/shm that was not there before."""
    before = shm_entries()
    yield
    left = shm_entries() - before
    assert not left, f"test left shared-memory entries behind: {sorted(left)}"


@pytest.fixture(autouse=True)
def no_segments_left_behind():
    """Each test of a module that imports this leaves no ktshm entry of this run in /dev/shm."""
    with no_new_segments():
        yield
