"""ktserve/parent_process.py: a child started with with_parent gets SIGTERM when its parent goes,
or exits at once when the parent went before it could follow. Real subprocesses."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

OBEYS_SIGTERM = 'import time; print("ready", flush=True); time.sleep(120)'
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
