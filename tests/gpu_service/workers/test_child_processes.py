"""Stopping the processes the GPU service starts: real subprocesses, one that obeys SIGTERM and
one that ignores it; and a child started with with_parent (ktserve/parent_process.py) gets
SIGTERM when its parent goes, or exits at once when the parent went before it could follow."""

from __future__ import annotations

import logging
import os
import select
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


FOLLOWS_PARENT = (
    "from ktserve.parent_process import follow_parent; follow_parent()\n" + OBEYS_SIGTERM
)


def test_a_child_started_with_parent_goes_with_its_parent():
    """A middle process starts a grandchild with with_parent() (no preexec_fn: Popen vforks),
    whose first act is follow_parent(), and exits: the grandchild gets SIGTERM (its
    parent-death signal) and ends."""
    middle = textwrap.dedent(f"""
        import subprocess, sys
        from ktserve.parent_process import with_parent
        child = subprocess.Popen([sys.executable, "-c", {FOLLOWS_PARENT!r}],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env=with_parent())
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True,
                          timeout=60, cwd=os.getcwd())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    grandchild = int(proc.stdout.strip())
    # NOTE: not our child, so no waitpid: its pidfd tells when it has ended
    try:
        fd = os.pidfd_open(grandchild)
    except ProcessLookupError:
        return  # already gone (and reaped by init)
    try:
        gone = bool(select.select([fd], [], [], 30)[0])
        if not gone:
            signal.pidfd_send_signal(fd, signal.SIGKILL)  # NOTE: leave nothing behind
        assert gone, f"pid {grandchild} outlived its parent"
    finally:
        os.close(fd)


def test_a_child_whose_parent_went_first_exits():
    """follow_parent() in a child whose recorded parent is no longer its parent (it died before
    the prctl): the child exits at once, naming the parent."""
    env = {**os.environ, "KTSERVE_PARENT_PID": str(os.getpid() + 10**6)}
    code = "from ktserve.parent_process import follow_parent; follow_parent(); print('stayed')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "stayed" not in proc.stdout
    assert "is gone" in proc.stderr
