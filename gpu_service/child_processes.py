"""What the GPU service does with the processes it starts (expert workers, tensor-parallel
followers): they die with it, and stopping them waits a bounded time before it kills."""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger("ktserve.gpu")

PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux: stopping them is the only way they are told to go
    _prctl = None


def die_with_parent() -> None:
    """Popen's preexec_fn: the child gets SIGTERM when the thread that started it ends (Linux)."""
    # NOTE: runs in the child between fork and exec: no imports, no allocation-heavy work.
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def wait_or_kill(procs: Sequence[subprocess.Popen], timeout_s: float, what: str) -> None:
    """Wait for procs (already told to stop) until timeout_s from now; kill those still running
    then, each with a warning naming `what` and its pid."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("%s pid %d did not stop within %.0f s: killed", what, proc.pid, timeout_s)
            proc.kill()
            proc.wait()
