"""What the benchmarks share: timing, the DRAM read bandwidth measured in the same run, and the
one table each prints.

NOTE: torch and the kernel are imported by the functions that use them: bench_ktshm's peer
processes import this module (through their parent's) and need neither.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ktserve.dram import dram_read_gbs

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "demo_model"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- timing
def time_calls(fn: Callable[[int], object], min_seconds: float, min_calls: int = 8) -> float:
    """Mean seconds per call of fn(i) over at least min_calls calls and min_seconds (after 2
    warm-ups)."""
    fn(0)
    fn(1)
    calls, t0 = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < min_seconds:
        fn(calls)
        calls += 1
    return (time.perf_counter() - t0) / calls


def latency_samples_us(step: Callable[[], object], iters: int) -> np.ndarray:
    """Microseconds of each of `iters` calls of step (after iters / 20, at least 10, warm-ups)."""
    for _ in range(max(iters // 20, 10)):
        step()
    samples = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        step()
        samples[i] = time.perf_counter_ns() - t0
    return samples / 1e3


# ----------------------------------------------------------------------------- idle check
def _thread_ticks() -> dict[tuple[str, str], tuple[str, int]]:
    """(pid, tid) -> (process/thread name, user + system clock ticks) of every thread."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks[(pid, tid)] = (name, int(fields[11]) + int(fields[12]))
    return ticks


def busy_while_idle(seconds: float = 1.0, top: int = 4) -> str:
    """What kept the host's CPUs busy over `seconds` while the benchmark itself waits: the cores
    busy in all (from /proc/stat) and the busiest threads (pid/tid name: % of a core). A thread
    left spinning (a pool, a poller) shows here and would steal a core from what runs next."""

    def cpu_jiffies() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values) - idle, sum(values)

    hz = os.sysconf("SC_CLK_TCK")
    busy0, total0 = cpu_jiffies()
    before = _thread_ticks()
    time.sleep(seconds)
    after = _thread_ticks()
    busy1, total1 = cpu_jiffies()
    cores = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    used = sorted(((after[k][1] - before[k][1], k, after[k][0]) for k in after if k in before),
                  reverse=True)[:top]  # fmt: skip
    threads = ", ".join(f"{pid}/{tid} {name}: {100 * t / hz / seconds:.0f}%"
                        for t, (pid, tid), name in used if t > 0)  # fmt: skip
    return f"{cores:.2f} cores busy" + (f" (busiest: {threads})" if threads else "")


# ----------------------------------------------------------------------------- memory
def llc_bytes() -> int:
    """The largest CPU cache of cpu0 (sysfs), 32 MiB where sysfs does not say."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def stream_read_gbs(threads: int, gb: float, pin: bool) -> float:
    """Best of 4 plain streaming reads of `gb` GB on a kernel pool like the one a benchmark times
    (same thread count and pinning; each thread one contiguous slice, the ISA's widest loads)."""
    from expert_service.kernels import MoEKernel

    buf = np.ones(int(gb * 1e9) // 8, dtype=np.uint64)
    best = 0.0
    with MoEKernel(threads, pin=pin) as kernel:
        for _ in range(4):
            t0 = time.perf_counter()
            kernel.stream_read(buf)
            best = max(best, buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


@dataclass
class DramMeter:
    """DRAM read bandwidth sampled through a run (start, between parts, end) two ways: torch.sum
    and a plain streaming read on a kernel pool; the bound is the higher of the two medians."""

    threads: int
    gb: float
    pin: bool = False
    samples: list[tuple[str, float, float]] = field(default_factory=list)  # (label, sum, stream)

    def sample(self, label: str) -> None:
        summed = dram_read_gbs(self.threads, self.gb)
        streamed = stream_read_gbs(self.threads, self.gb, self.pin)
        self.samples.append((label, summed, streamed))
        print(f"DRAM read ({label}): torch.sum {summed:.1f} GB/s, kernel threads "
              f"{streamed:.1f} GB/s", flush=True)  # fmt: skip

    @property
    def medians(self) -> tuple[float, float]:
        """(torch.sum, streaming) medians in GB/s."""
        return (statistics.median(s for _, s, _ in self.samples),
                statistics.median(s for _, _, s in self.samples))  # fmt: skip

    @property
    def gbs(self) -> float:
        return max(self.medians)

    def summary(self) -> str:
        summed, streamed = self.medians
        return (
            f"DRAM read samples over {self.gb:g} GB, {self.threads} threads: torch.sum "
            + ", ".join(f"{s:.1f}" for _, s, _ in self.samples)
            + f" GB/s (median {summed:.1f}); the kernel's threads streaming "
            + ", ".join(f"{s:.1f}" for _, _, s in self.samples)
            + f" GB/s (median {streamed:.1f}). %DRAM is against the higher median, "
            + f"{self.gbs:.1f} GB/s"
        )


class GcPauses:
    """The cyclic garbage collector's pauses in this process while installed (gc.callbacks):
    count and seconds, all generations together. Any thread's collection holds the GIL, so it
    stalls the engine thread as well."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._began

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


# ----------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Column:
    title: str
    width: int
    align: str = ">"  # "<" for text


def print_table(
    columns: Sequence[Column], rows: Iterable[Sequence[str]], sep: str = " | ", rule: bool = True
) -> None:
    """A header, a rule as long as it (if rule), and one line per row of formatted cells."""
    head = sep.join(f"{c.title:{c.align}{c.width}}" for c in columns).rstrip()
    print(head)
    if rule:
        print("-" * len(head))
    for row in rows:
        cells = (f"{cell:{c.align}{c.width}}" for c, cell in zip(columns, row, strict=True))
        print(sep.join(cells).rstrip())


def run_make_or_check(
    doc: str, make: Callable[[Path, int], None], check: Callable[[Path, str], int]
) -> int:
    """The command line of a reference check made here and checked on the GPU host: `make DIR
    [--seed N]` writes the references, `check DIR [--device D]` compares (its exit code)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("what", choices=("make", "check"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.what == "make":
        make(args.dir, args.seed)
        return 0
    return check(args.dir, args.device)
