"""A subprocess whose stdout lines are read with deadlines, for tests of several processes."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Children import the repo first, then whatever the parent could import (site dirs on the GPU host).
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}


class WatchedProcess:
    """Runs `cmd` in the repo root; a thread pumps stdout lines into a queue (select() on a
    buffered pipe misses lines already read ahead), stderr goes to a file (a pipe nobody reads
    would fill and block the process's logging)."""

    what = "the process"

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close_streams())
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            env={**CHILD_ENV, **(env or {})},
        )  # fmt: skip
        threading.Thread(target=self._pump, daemon=True).start()

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
                raise TimeoutError(f"{self.what} printed no line matching {pattern!r}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise RuntimeError(f"{self.what} exited ({code}):\n{self.stderr()}")
            if re.search(pattern, line):
                return line

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close_streams(self) -> None:
        self.proc.stdout.close()
        self._stderr.close()
