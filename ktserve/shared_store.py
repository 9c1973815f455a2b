"""The packed store a worker writes when it packs a checkpoint at load: in /dev/shm, so that the
tmpfs pages are the one copy of the experts in RAM, mapped by the worker (its kernel reads them)
and by a GPU service on the same host (prefill streams them to the GPU).

    /dev/shm/<ktshm name prefix>store.<pid>.<random>/     0700, the worker's uid
        owner                "<pid> <start time in clock ticks>" of the worker that made it
        layer_LLL.bin ...    packed_store's files, and its index last

The worker removes it when it exits. After a kill -9 nobody does: the next worker to create a
store (or `cleanup_stale`) removes every store whose owner process is gone.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

import ktshm

log = logging.getLogger("ktserve.expert")

ROOT = Path("/dev/shm")
MARK = "store."
OWNER_FILE = "owner"
HEADROOM_BYTES = 256 << 20  # left free on the tmpfs beyond the store


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def create(required_bytes: int) -> Path | None:
    """A new empty store directory, or None (logged) when the tmpfs has no room for it."""
    cleanup_stale()
    try:
        vfs = os.statvfs(ROOT)
    except OSError as exc:
        log.warning("no %s (%s): packed experts stay in private memory", ROOT, exc)
        return None
    free = vfs.f_bavail * vfs.f_frsize
    if free < required_bytes + HEADROOM_BYTES:
        log.warning("%s has %.1f GiB free, the packed experts need %.1f GiB: they stay in "
                    "private memory, and prefill cannot stream them to the GPU", ROOT,
                    free / 2**30, required_bytes / 2**30)  # fmt: skip
        return None
    pid = os.getpid()
    path = ROOT / f"{ktshm.name_prefix()}{MARK}{pid}.{secrets.token_hex(8)}"
    path.mkdir(mode=0o700)
    # NOTE: whole or absent (a rename): another worker's cleanup may read it meanwhile
    partial = path / f"{OWNER_FILE}.partial"
    partial.write_text(f"{pid} {_start_ticks(pid)}\n")
    partial.replace(path / OWNER_FILE)
    return path


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def is_store_name(name: str) -> bool:
    return name.startswith(ktshm.SEGMENT_PREFIX) and f".{MARK}" in f".{name.split('.', 1)[1]}"


def owner_alive(path: Path) -> bool:
    """Whether the process that made the store still runs (the same pid and start time). A store
    without its owner file yet is being made: alive while the pid in its name runs."""
    try:
        pid_text, ticks_text = (path / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        pid = _named_pid(path)
        return pid is not None and _start_ticks(pid) is not None
    return str(_start_ticks(int(pid_text))) == ticks_text


def _named_pid(path: Path) -> int | None:
    """The pid in a store's name (<prefix>store.<pid>.<random>), or None."""
    rest = path.name.rsplit(MARK, 1)[-1].split(".")
    return int(rest[0]) if len(rest) == 2 and rest[0].isdigit() else None


def cleanup_stale() -> list[str]:
    """Remove the stores of this uid whose owner is gone; returns their names."""
    removed = []
    try:
        entries = list(ROOT.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not is_store_name(entry.name):
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not entry.is_dir() or entry.is_symlink():
            continue
        if not owner_alive(entry):
            remove(entry)
            removed.append(entry.name)
            log.info("removed the packed store %s (its worker is gone)", entry)
    return removed
