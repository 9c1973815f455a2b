"""`ktserve expert` as a real subprocess, and a client for it, for tests of several processes."""

from __future__ import annotations

import os
import re
import sys

import grpc
import numpy as np
import pytest
from watched_process import WatchedProcess

import ktshm
from ktserve import wire
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc

FORMAT_PB = {"bf16": pb.WEIGHT_FORMAT_BF16, "int8": pb.WEIGHT_FORMAT_INT8,
             "int4": pb.WEIGHT_FORMAT_INT4}  # fmt: skip


class ExpertProcess(WatchedProcess):
    """`python -m ktserve expert ...` on a free port; stdout read with deadlines."""

    what = "the expert process"

    def __init__(self, *args: str, env: dict[str, str] | None = None, wait_serving: bool = True):
        cmd = [sys.executable, "-m", "ktserve", "expert", "--listen", "127.0.0.1:0",
               "--threads", "1", *args]  # fmt: skip
        super().__init__(cmd, env)
        self.grpc_channel = None
        try:
            line = self.read_line(r"listening on (\S+)")
            self.address = re.search(r"listening on (\S+)", line).group(1)
            self.grpc_channel = grpc.insecure_channel(self.address)
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


def moe_call(channel: ktshm.Channel, layer: int, x: np.ndarray, ids: np.ndarray,
             weights: np.ndarray, timeout: float = 30.0) -> np.ndarray:  # fmt: skip
    """One MoE call through the channel; returns y [T, H] float32 (a copy)."""
    return channel.call(
        wire.KIND_MOE, layer,
        [np.ascontiguousarray(x, np.float32), np.ascontiguousarray(ids, np.int32),
         np.ascontiguousarray(weights, np.float32)],
        num_tokens=x.shape[0], timeout=timeout,
    )[0]  # fmt: skip


def shm_entries() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if "ktshm." in e}


@pytest.fixture(autouse=True)
def no_segments_left_behind():
    """Each test of a module that imports this leaves no ktshm entry in /dev/shm."""
    before = shm_entries()
    yield
    left = shm_entries() - before
    assert not left, f"test left shared-memory entries behind: {sorted(left)}"
