"""A `ktserve expert` worker subprocess for the benchmarks, waited for until it serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_worker(model: Path | str, fmt: str, threads: int,
                 spin_us: float | None = None) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """(the process, its gRPC address) once it prints that it serves `model`. spin_us: how long
    its channel thread and its kernel pool spin before they sleep (default: the worker's)."""
    extra, env = [], dict(os.environ)
    if spin_us is not None:
        extra = ["--spin-us", str(spin_us)]
        env["KTSERVE_KERNEL_SPIN_US"] = str(int(spin_us))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ktserve", "expert", "--model", str(model),
         "--format", fmt, "--threads", str(threads), "--listen", "127.0.0.1:0", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    address = None
    for line in proc.stdout:
        if m := re.search(r"listening on (\S+)", line):
            address = m.group(1)
        if "serving" in line:
            return proc, address
    raise RuntimeError(f"expert worker exited with {proc.wait()}")
