"""A `ktserve expert` worker subprocess for the benchmarks, waited for until it serves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_worker(model: Path | str, fmt: str, threads: int) -> tuple[subprocess.Popen, str]:
    """(the process, its gRPC address) once it prints that it serves `model`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "expert_service.cli", "expert", "--model", str(model),
         "--format", fmt, "--threads", str(threads), "--listen", "127.0.0.1:0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    address = None
    for line in proc.stdout:
        if m := re.search(r"listening on (\S+)", line):
            address = m.group(1)
        if "serving" in line:
            return proc, address
    raise RuntimeError(f"expert worker exited with {proc.wait()}")
