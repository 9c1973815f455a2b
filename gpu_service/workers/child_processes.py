"""What the GPU service does with the processes it starts (expert workers, tensor-parallel
followers): stopping them waits a bounded time before it kills. (That they die with it:
ktserve/parent_process.py.)"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger("ktserve.gpu")


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
