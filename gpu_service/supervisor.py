"""Expert workers as supervised subprocesses of `ktserve serve`.

Each worker is `python -m ktserve expert --model M --listen 127.0.0.1:PORT ...` on a
port fixed for its life, so a restarted worker answers at the same address and the GPU side's
ShmExperts re-attaches to it by itself. Per worker:

    STARTING --prints "ktserve expert: serving"--> SERVING --exits--> EXITED
        ^                                                                | restart_workers
        +---------------------- respawned (after a backoff) -------------+

Workers' stdout is read line by line (echoed with a "[expert i]" prefix); their stderr (load
progress bars) goes straight to this process's stderr. Workers run in their own process group,
so a Ctrl+C in the terminal reaches only the server, which then SIGTERMs them (they drain); on
Linux they also get SIGTERM should the server die without stopping them.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("ktserve.supervisor")

SERVING_MARK = "ktserve expert: serving"
POLL_S = 0.1
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that lived this long restarts without delay
PR_SET_PDEATHSIG = 1


class WorkerStartError(RuntimeError):
    """An expert worker exited or did not load in time."""


@dataclass(frozen=True)
class WorkerSpec:
    """One expert worker: its gRPC address and the command line that runs it."""

    index: int
    address: str
    experts: str
    argv: tuple[str, ...]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_specs(
    model_dir: str, ranges: tuple[str, ...], weight_format: str, threads: int | None
) -> list[WorkerSpec]:
    specs = []
    for i, experts in enumerate(ranges):
        address = f"127.0.0.1:{free_port()}"
        argv = [
            sys.executable,
            "-m",
            "ktserve",
            "expert",
            "--model",
            model_dir,
            "--listen",
            address,
            "--experts",
            experts,
            "--format",
            weight_format,
        ]
        if threads is not None:
            argv += ["--threads", str(threads)]
        specs.append(WorkerSpec(i, address, experts, tuple(argv)))
    return specs


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen | None = None
    state: str = "starting"
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None
    restart_at: float = 0.0
    serving: threading.Event = field(default_factory=threading.Event)


try:
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux: stop() is the only way the workers are told to go
    _prctl = None


def _die_with_parent() -> None:
    # NOTE: runs in the child between fork and exec: no imports, no allocation-heavy work.
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class Supervisor:
    """Starts the workers, waits until they serve, restarts those that exit, stops them all."""

    def __init__(
        self, specs: list[WorkerSpec], restart: bool = True, drain_timeout_s: float = 35.0
    ) -> None:
        self.workers = [_Worker(spec) for spec in specs]
        self.restart = restart
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(w.spec.address for w in self.workers)

    def start(self, timeout_s: float) -> None:
        """Spawn every worker and return once all serve; WorkerStartError otherwise."""
        for worker in self.workers:
            self._spawn(worker)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not worker.serving.wait(POLL_S):
                code = worker.proc.poll()
                if code is not None:
                    raise WorkerStartError(
                        f"expert worker {worker.spec.index} (experts {worker.spec.experts}) "
                        f"exited with code {code} while loading; its messages are above"
                    )
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"expert worker {worker.spec.index} did not load in {timeout_s:.0f} s"
                    )
        self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._monitor.start()

    def status(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "index": w.spec.index,
                    "address": w.spec.address,
                    "experts": w.spec.experts,
                    "state": w.state,
                    "pid": w.proc.pid if w.proc else None,
                    "restarts": w.restarts,
                    "exit_code": w.exit_code,
                }
                for w in self.workers
            ]

    def stop(self) -> None:
        """SIGTERM every worker (they answer their calls in flight), then wait; kill laggards."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        with self._lock:
            procs = [w.proc for w in self.workers if w.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("expert worker pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ internals
    def _spawn(self, worker: _Worker) -> None:
        worker.serving.clear()
        proc = subprocess.Popen(
            worker.spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            bufsize=1,
            process_group=0,
            preexec_fn=_die_with_parent,
        )
        with self._lock:
            worker.proc = proc
            worker.state = "starting"
            worker.exit_code = None
            worker.started_at = time.monotonic()
        log.info(
            "expert worker %d (experts %s) started: pid %d, %s",
            worker.spec.index,
            worker.spec.experts,
            proc.pid,
            worker.spec.address,
        )
        threading.Thread(
            target=self._pump,
            args=(worker, proc),
            daemon=True,
            name=f"expert-{worker.spec.index}-stdout",
        ).start()

    def _pump(self, worker: _Worker, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            print(f"[expert {worker.spec.index}] {line}", end="", flush=True)
            if SERVING_MARK in line:
                with self._lock:
                    if worker.proc is proc:
                        worker.state = "serving"
                worker.serving.set()
        proc.stdout.close()

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            for worker in self.workers:
                self._check(worker)

    def _check(self, worker: _Worker) -> None:
        now = time.monotonic()
        if worker.state == "restarting":
            if now >= worker.restart_at:
                worker.restarts += 1
                self._spawn(worker)
            return
        code = worker.proc.poll()
        if code is None or worker.state == "exited":
            return
        with self._lock:
            worker.exit_code = code
            worker.state = "restarting" if self.restart else "exited"
        if not self.restart:
            log.error(
                "expert worker %d (pid %d) exited with code %s; not restarting it "
                "(--no-restart-workers)",
                worker.spec.index,
                worker.proc.pid,
                code,
            )
            return
        lived = now - worker.started_at
        delay = 0.0 if lived > STABLE_S else min(2.0**worker.restarts, MAX_BACKOFF_S) * 0.5
        worker.restart_at = now + delay
        log.warning(
            "expert worker %d (pid %d) exited with code %s; restarting it in %.1f s",
            worker.spec.index,
            worker.proc.pid,
            code,
            delay,
        )
