"""The expert worker's configuration; `ktserve expert` flags map one-to-one onto it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ktserve.checkpoint import parse_expert_range
from ktserve.names import check_weight_format


def default_num_threads() -> int:
    """All cores this process may use but one, which is left to the thread feeding the kernel."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True)
class WorkerConfig:
    """model: checkpoint or `ktserve convert` directory to load at start (None: wait for LoadModel).
    listen: gRPC address, "127.0.0.1:PORT" or "unix:/path.sock".
    experts: expert id range held, "START-END" inclusive (None: all).
    weight_format: bf16, int8 or int4.
    threads: kernel threads (None: cores - 1).
    metrics_port: Prometheus HTTP port (0: none), bound on metrics_host.
    spin_us: how long a channel thread spins for the next request before it blocks.
    drain_timeout_s: how long SIGTERM/Drain waits for in-flight calls.
    """

    model: str | None = None
    listen: str = "127.0.0.1:50061"
    experts: str | None = None
    weight_format: str = "int8"
    threads: int | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    spin_us: float = 200.0
    drain_timeout_s: float = 30.0
    isa: str | None = None

    def __post_init__(self) -> None:
        check_weight_format(self.weight_format)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.experts is not None:
            parse_expert_range(self.experts)
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s must be positive, got {self.drain_timeout_s}")

    @property
    def num_threads(self) -> int:
        return self.threads or default_num_threads()

    @property
    def expert_range(self) -> range | None:
        return parse_expert_range(self.experts) if self.experts is not None else None
