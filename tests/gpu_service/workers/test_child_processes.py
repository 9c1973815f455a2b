"""Stopping the processes the GPU service starts: real subprocesses, one that obeys SIGTERM and
one that ignores it."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap

from gpu_service.workers.child_processes import wait_or_kill

IGNORES_SIGTERM = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
""")
OBEYS_SIGTERM = 'import time; print("ready", flush=True); time.sleep(120)'


def started(code: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **kw)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_wait_or_kill_kills_only_what_outlives_the_timeout(caplog):
    obeys, ignores = started(OBEYS_SIGTERM), started(IGNORES_SIGTERM)
    try:
        for proc in (obeys, ignores):
            proc.send_signal(signal.SIGTERM)
        with caplog.at_level(logging.WARNING, logger="ktserve.gpu"):
            wait_or_kill([obeys, ignores], 1.0, "test child")
        assert obeys.returncode == -signal.SIGTERM
        assert ignores.returncode == -signal.SIGKILL
        [record] = [r for r in caplog.records if "test child" in r.getMessage()]
        assert f"pid {ignores.pid} did not stop within 1 s: killed" in record.getMessage()
    finally:
        for proc in (obeys, ignores):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
