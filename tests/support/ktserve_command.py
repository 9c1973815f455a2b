"""`python -m ktserve ...` run to completion in the repo root, its output captured."""

from __future__ import annotations

import subprocess
import sys

from tests.support.watched_process import CHILD_ENV, REPO


def ktserve(
    *args: str, timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ktserve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**CHILD_ENV, **(env or {})},
    )
