"""Rank 0's side of tensor parallelism: start the followers, join the group with them, hand each
step to them, notice when one dies, stop them.

    start():  a TCPStore on a free port (bound here: no race for it), N-1 followers started
              with their Setup (follower.py), each awaited at "alive/<rank>", then the process
              group (NCCL on CUDA, gloo on the CPU)
    rank 0 loads its own share meanwhile (the followers load theirs at the same time)
    ready():  each follower awaited at "loaded/<rank>"
    every checked forward (CausalLM.step_listener): the Cache when rank 0's KV cache object
              changed, then the Step, written to every follower's stdin before rank 0 starts
              the step's collectives (the followers run the same ones, in the same order)
    close():  Stop, then each follower awaited, killed past a deadline

Every wait polls the followers: one that exits fails the wait at once with its exit status
(TensorParallelFailed); a follower that is alive but silent fails it at --tensor-parallel-timeout.
Once a follower has failed, every later step fails at once with the same error; so does a step
of rank 0's that raised part-way (the followers may be left inside a collective: pairing the next
step's with it would compute garbage). A thread per follower waits for its exit outside of steps
too. The first failure calls on_failure (`ktserve serve`: stop serving, exit status 1).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_service.attention.backend import AttentionBackend
from gpu_service.attention.batch import Batch
from gpu_service.layers.sharding import TensorParallel
from gpu_service.layers.weight_formats import LinearQuantConfig
from gpu_service.models.model import CausalLM
from gpu_service.tensor_parallel.messages import Cache, Message, Setup, Step, Stop, encode
from gpu_service.workers.child_processes import wait_or_kill
from ktserve.parent_process import with_parent

log = logging.getLogger("ktserve.gpu")
STOP_TIMEOUT_S = 10.0
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
POLL_S = 0.2


class TensorParallelFailed(RuntimeError):
    """A follower exited or stopped answering: the tensor-parallel group cannot run steps."""


@dataclass(frozen=True)
class LeaderConfig:
    world_size: int
    model_dir: str
    device: torch.device  # rank 0's; rank r runs on the same type, index + r on CUDA
    dtype: torch.dtype
    linear_quant: LinearQuantConfig
    attention: AttentionBackend  # rank 0's, chosen at its load: every rank runs the same kernels
    timeout_s: float

    def device_of(self, rank: int) -> torch.device:
        if self.device.type != "cuda":
            return self.device
        return torch.device("cuda", (self.device.index or 0) + rank)


def check_devices(world_size: int, device: torch.device) -> None:
    """ValueError unless a tensor-parallel group of world_size fits the visible GPUs."""
    if world_size == 1 or device.type != "cuda":
        return
    first, visible = device.index or 0, torch.cuda.device_count()
    if first + world_size > visible:
        raise ValueError(
            f"--tensor-parallel-size {world_size} from {device} needs cuda:{first}.."
            f"cuda:{first + world_size - 1}, but {visible} GPUs are visible "
            "(CUDA_VISIBLE_DEVICES)"
        )


class TensorParallelLeader:
    def __init__(self, config: LeaderConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.store: dist.TCPStore | None = None
        self.tp: TensorParallel | None = None
        self.failure: TensorParallelFailed | None = None
        self._cache_sent: object | None = None
        self.model: CausalLM | None = None
        self.on_failure: Callable[[TensorParallelFailed], None] | None = None
        self._closing = threading.Event()

    @property
    def backend(self) -> str:
        return "nccl" if self.config.device.type == "cuda" else "gloo"

    def start(self) -> TensorParallel:
        cfg = self.config
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        if cfg.device.type == "cuda":
            torch.cuda.set_device(cfg.device)  # NOTE: NCCL binds rank 0 to the current device
        self.store = dist.TCPStore("127.0.0.1", 0, cfg.world_size, is_master=True,
                                   timeout=timeout, wait_for_workers=False)  # fmt: skip
        # NOTE: NVLink multicast off (the GPU host); the followers import this very tree
        path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": path}
        for rank in range(1, cfg.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "gpu_service.tensor_parallel.follower"],
                                    stdin=subprocess.PIPE, env=with_parent(env))  # fmt: skip
            self.procs.append(proc)
            self._send(proc, rank, self._setup(rank))
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"tp-watch-{rank}").start()  # fmt: skip
        self._await("alive", "start")
        dist.init_process_group(self.backend, store=self.store, rank=0,
                                world_size=cfg.world_size, timeout=timeout)  # fmt: skip
        self.tp = TensorParallel(0, cfg.world_size, dist.group.WORLD)
        log.info("tensor parallelism: %d ranks (%s), followers' pids %s", cfg.world_size,
                 self.backend, [p.pid for p in self.procs])  # fmt: skip
        return self.tp

    def _setup(self, rank: int) -> Setup:
        cfg = self.config
        return Setup(rank, cfg.world_size, self.store.port, self.backend, cfg.timeout_s,
                     str(Path(cfg.model_dir).resolve()), str(cfg.device_of(rank)), cfg.dtype,
                     cfg.linear_quant, cfg.attention)  # fmt: skip

    def ready(self, model: CausalLM) -> None:
        """Wait until every follower has loaded its share; then hand them model's steps."""
        self._await("loaded", "load its share of the model")
        self.model = model
        model.step_listener = self
        self.sync_cache(model)

    def sync_cache(self, model: CausalLM) -> None:
        """Give the followers a KV cache like model's (sizes; each holds its own heads)."""
        cache = model.kv_cache
        if cache is not self._cache_sent:
            self._broadcast(Cache(cache.config.max_num_tokens, cache.layers[0][0].dtype,
                                  cache.config.block_size))  # fmt: skip
            self._cache_sent = cache

    def on_step(self, batch: Batch, all_positions: bool) -> None:
        """Before rank 0's forward (CausalLM.step_listener): the step to every follower."""
        self._check_alive()
        # NOTE: a cache swapped in (the memory plan's profiling caches) goes first: the
        # followers run the step on one of the same size, with the blocks rank 0 assigned
        self.sync_cache(self.model)
        self._broadcast(Step.of(batch, all_positions))

    def on_step_failed(self, exc: BaseException) -> None:
        """Rank 0's forward raised (e.g. an expert worker gone past --worker-timeout): the
        followers may be waiting in a collective rank 0 left, so the group is out of step for
        good; every later step fails rather than pairing the wrong collectives."""
        self._check_alive()
        self._fail(f"rank 0's step failed part-way ({type(exc).__name__}: {exc}), leaving the "
                   "followers out of step")  # fmt: skip

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing.is_set():
            self._fail(f"tensor-parallel follower rank {rank} (pid {proc.pid}) exited "
                       f"with status {code}")  # fmt: skip

    def close(self) -> None:
        self._closing.set()
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is None:
                try:
                    self._send(proc, rank, Stop())
                    proc.stdin.close()
                except (TensorParallelFailed, OSError):
                    pass
        wait_or_kill(self.procs, STOP_TIMEOUT_S, "tensor-parallel follower")
        self.procs = []
        if self.tp is not None:
            dist.destroy_process_group()
            self.tp = None
        self.store = None

    def _broadcast(self, message: Message) -> None:
        data = encode(message)
        for rank, proc in enumerate(self.procs, start=1):
            self._write(proc, rank, data)

    def _send(self, proc: subprocess.Popen, rank: int, message: Message) -> None:
        self._write(proc, rank, encode(message))

    def _write(self, proc: subprocess.Popen, rank: int, data: bytes) -> None:
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            self._check_alive()
            raise self._fail(f"tensor-parallel follower rank {rank} (pid {proc.pid}) stopped "
                             "reading its steps") from exc  # fmt: skip

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise self._fail(f"tensor-parallel follower rank {rank} (pid {proc.pid}) exited "
                                 f"with status {code}")  # fmt: skip

    def _fail(self, what: str) -> TensorParallelFailed:
        if self.failure is None:
            self.failure = TensorParallelFailed(
                f"{what}: the tensor-parallel group is broken and this service cannot run "
                "steps; restart it"
            )
            log.error("%s", self.failure)
            if self.on_failure is not None:
                self.on_failure(self.failure)
        return self.failure

    def _await(self, key: str, doing: str) -> None:
        """Until every follower has stored `key`/<rank>; one that exits meanwhile fails it."""
        deadline = time.monotonic() + self.config.timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            while not self.store.check([f"{key}/{rank}"]):
                if time.monotonic() > deadline:
                    raise self._fail(
                        f"tensor-parallel follower rank {rank} did not {doing} within "
                        f"--tensor-parallel-timeout {self.config.timeout_s:g} s"
                    )
                try:
                    proc.wait(timeout=POLL_S)  # NOTE: returns at once if it exits
                except subprocess.TimeoutExpired:
                    continue
                self._check_alive()
