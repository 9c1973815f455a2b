"""`ktserve expert` as a real subprocess, and a client for it, for tests of several processes."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

import ktshm
from expert_service import wire
from expert_service.protocol import expert_pb2 as pb
from expert_service.protocol import expert_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
FORMAT_PB = {"bf16": pb.WEIGHT_FORMAT_BF16, "int8": pb.WEIGHT_FORMAT_INT8,
             "int4": pb.WEIGHT_FORMAT_INT4}  # fmt: skip


class ExpertProcess:
    """`python -m expert_service.cli expert ...` on a free port; stdout read with deadlines."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, wait_serving: bool = True):
        cmd = [sys.executable, "-m", "expert_service.cli", "expert", "--listen", "127.0.0.1:0",
               "--threads", "1", *args]  # fmt: skip
        self.output: list[str] = []
        # NOTE: stderr to a file, not a pipe: nobody reads it while the process runs, and a full
        # pipe would block the worker's progress bar and logging.
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
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

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def read_line(self, pattern: str, timeout: float = 120.0) -> str:
        """The first stdout line matching `pattern`; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"expert process printed no line matching {pattern!r}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise RuntimeError(f"expert process exited ({code}): {self.stderr()}")
            if re.search(pattern, line):
                return line

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def attach(self, channel: ktshm.Channel) -> int:
        return self.stub.Attach(pb.AttachRequest(channel_name=channel.name), timeout=30).epoch

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.grpc_channel is not None:
            self.grpc_channel.close()
        self.kill()
        self.proc.stdout.close()
        self._stderr.close()


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
