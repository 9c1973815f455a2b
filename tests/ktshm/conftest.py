from __future__ import annotations

import select
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.expert_procs import no_segments_left_behind, shm_entries  # noqa: F401 - autouse
from tests.support.watched_process import CHILD_ENV, REPO


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


class ConsumerProcess:
    def __init__(self, name: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.consumer_proc", name, *args],
            cwd=REPO,
            env=CHILD_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read_line(self, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("consumer process said nothing in time")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"consumer exited with {self.proc.wait()}")
                return line.strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture
def spawn_consumer():
    procs: list[ConsumerProcess] = []

    def spawn(name: str, *args: str) -> ConsumerProcess:
        p = ConsumerProcess(name, *args)
        procs.append(p)
        assert p.read_line().startswith("ready")
        return p

    yield spawn
    for p in procs:
        p.kill()
