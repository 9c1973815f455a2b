"""A `ktserve expert` worker subprocess for the benchmarks, waited for until it serves."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from expert_service import synthetic_experts
from tests.support.watched_process import WatchedProcess


@contextlib.contextmanager
def expert_worker(model: Path | str, fmt: str, threads: int, spin_us: float | None = None,
                  timeout: float = 600.0, extra_args: tuple[str, ...] = (),
                  tree: Path | str | None = None) -> Iterator[str]:  # fmt: skip
    """The gRPC address of a worker serving `model` (waited for up to `timeout` s), stopped when
    the block ends: a Unix socket in a private (0700) directory, so it takes calls without a
    token. spin_us: how long its channel thread and its kernel pool spin before they sleep
    (default: the worker's). extra_args: more `ktserve expert` flags. tree: run the worker's
    code from that source tree (its built extensions included), e.g. an older commit's. A
    checkpoint of synthetic experts (bench/real_checkpoint.py --experts synthetic) is let
    through: this is a benchmark."""
    extra, env, python = list(extra_args), {}, [sys.executable]
    if synthetic_experts.is_synthetic_dir(Path(model)):
        env[synthetic_experts.ENV] = "1"
    if spin_us is not None:
        extra += ["--spin-us", str(spin_us)]
        env["KTSERVE_KERNEL_SPIN_US"] = str(int(spin_us))
    if tree is not None:
        python.append("-P")  # NOTE: else the working directory (this tree) comes first
        # the tree first, then what else the path held (carried wheels) but this tree
        here = Path(__file__).resolve().parent.parent
        rest = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if e and Path(e).resolve() != here]  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve()), *rest])
    socket_dir = tempfile.TemporaryDirectory(prefix="ktserve-bench-")  # mode 0700
    proc = WatchedProcess(
        [*python, "-m", "ktserve", "expert", "--model", str(model), "--format", fmt,
         "--threads", str(threads), "--listen", f"unix:{socket_dir.name}/worker.sock", *extra],
        env,
    )  # fmt: skip
    proc.what = "the expert worker"
    try:
        line = proc.read_line(r"listening on (\S+)", timeout)
        address = re.search(r"listening on (\S+)", line).group(1)
        proc.read_line(r"serving", timeout)
        yield address
    finally:
        try:
            proc.terminate(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.close_streams()
        socket_dir.cleanup()
