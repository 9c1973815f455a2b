"""A child that dies with the process that started it (Linux: PR_SET_PDEATHSIG).

The parent starts it with env=with_parent(...); the child calls follow_parent() first thing.
No preexec_fn, so Popen need not fork a Python child: it vforks, and no fork handler runs. (With
a preexec_fn, a gRPC call in flight on another thread across the fork made gRPC skip its fork
handlers and the child could abort: an expert worker restarted after a kill died again.)
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping

from ktserve import envs

PARENT_ENV = envs.PARENT_PID.name
PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux: stopping them is the only way they are told to go
    _prctl = None


def with_parent(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Popen's env (default: ours) for a child that is to die with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """First thing in a child started with with_parent(): SIGTERM when the thread that started
    it ends; if its parent is gone already, exit. Elsewhere: nothing."""
    parent = os.environ.pop(PARENT_ENV, None)  # NOTE: not handed down to grandchildren
    if parent is None or _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != int(parent):  # NOTE: it died before the prctl: no signal will come
        raise SystemExit(f"the process that started this one (pid {parent}) is gone")
