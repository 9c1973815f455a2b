"""Where a worker runs: its CPUs (sched_setaffinity, for every thread of the process) and the
NUMA node its memory comes from (set_mempolicy(MPOL_BIND), for the calling thread), set before
the worker starts its own threads.

# NOTE: both are per thread and inherited at creation: placed first, the kernel's pool threads,
# the packing threads and gRPC's all follow, and every page the shard allocates or faults in
# (a /dev/shm store's too) comes from the bound node.
Where binding is impossible (no such syscall, EPERM in a container without CAP_SYS_NICE) the
worker warns and runs unbound.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass

from ktserve.numa import format_cpulist

log = logging.getLogger("ktserve.expert")

MPOL_BIND = 2
# set_mempolicy / get_mempolicy syscall numbers
SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}
MASK_BITS = 1024


@dataclass(frozen=True)
class Placement:
    """What was applied: the CPUs the process runs on and the node its memory is bound to
    (None: not bound)."""

    cpus: tuple[int, ...]
    memory_node: int | None


def place_worker(cpus: tuple[int, ...] | None, numa_node: int | None) -> Placement:
    """Pin this thread (and those it starts) to cpus and bind its memory to numa_node; either
    None leaves that as it is. ValueError for CPUs this process may not use."""
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        outside = sorted(set(cpus) - allowed)
        if outside:
            raise ValueError(
                f"--cpus {format_cpulist(cpus)}: CPUs {format_cpulist(outside)} are not among "
                f"those this process may use ({format_cpulist(allowed)})"
            )
        for thread in _threads():  # NOTE: those already running too (numpy's BLAS pool)
            os.sched_setaffinity(thread, cpus)
    bound = None
    if numa_node is not None:
        error = bind_memory(numa_node)
        if error is None:
            bound = numa_node
        else:
            log.warning("memory not bound to NUMA node %d (%s): the shard's pages go where the "
                        "kernel puts them", numa_node, error)  # fmt: skip
    return Placement(tuple(sorted(os.sched_getaffinity(0))), bound)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def bind_memory(node: int) -> str | None:
    """set_mempolicy(MPOL_BIND, {node}) for this thread; None on success, else why not."""
    if not 0 <= node < MASK_BITS:
        raise ValueError(f"NUMA node {node} is out of range [0, {MASK_BITS})")
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None or not hasattr(ctypes.CDLL(None), "syscall"):
        return f"set_mempolicy is not known on {platform.machine()}"
    mask = _node_mask(node)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(numbers[0], MPOL_BIND, mask, ctypes.c_ulong(MASK_BITS)) != 0:
        errno = ctypes.get_errno()
        return f"set_mempolicy: {os.strerror(errno)}"
    return None


def memory_policy() -> tuple[int, tuple[int, ...]]:
    """This thread's (mode, nodes) from get_mempolicy (mode 0: the default policy)."""
    numbers = SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    mode, mask = ctypes.c_int(-1), _node_mask(None)
    if libc.syscall(numbers[1], ctypes.byref(mode), mask, ctypes.c_ulong(MASK_BITS), None, 0):
        raise OSError(ctypes.get_errno(), "get_mempolicy failed")
    word_bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = tuple(n for n in range(MASK_BITS) if mask[n // word_bits] >> (n % word_bits) & 1)
    return mode.value, nodes


def bound_node() -> int:
    """The one node this thread's memory is bound to (MPOL_BIND); -1 for any other policy."""
    try:
        mode, nodes = memory_policy()
    except (OSError, KeyError):
        return -1
    return nodes[0] if mode == MPOL_BIND and len(nodes) == 1 else -1


def _node_mask(node: int | None) -> ctypes.Array:
    word_bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (MASK_BITS // word_bits))()
    if node is not None:
        mask[node // word_bits] = 1 << (node % word_bits)
    return mask
