"""Two device buffers, each one MoE layer's packed experts (every worker's store, in expert id
order), filled from the mapped stores while the other layer computes:

    copy stream:    [L   -> slot a] [L+1 -> slot b]            [L+2 -> slot a] ...
    compute stream:                 [compute L from a] [L+1 from b] ...
                    a copy into a slot waits for the event "the last compute that read it is
                    queued" (released), a compute waits for "its copy is done" (copied)

On CUDA the copies are asynchronous on a side stream from the mappings registered as pinned
memory (cudaHostRegister, read-only); where registration fails they still run, from pageable
memory (slower; logged). On the CPU a copy is a tensor copy, in order (the same code path).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from gpu_service.experts.stream_prefill.store import MappedStore

log = logging.getLogger("ktserve.gpu")

NUM_SLOTS = 2  # the layer computing and the next one, copying
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable

# NOTE: uint16 (bf16 bits) is staged as int16: torch has few uint16 kernels on CUDA
_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8,
                 np.dtype(np.uint16): torch.int16, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}  # fmt: skip


@dataclass
class _Slot:
    tensors: dict[str, torch.Tensor]  # name -> [E, per expert] on the device
    layer: int | None = None
    copied: torch.cuda.Event | None = None
    released: torch.cuda.Event | None = None
    used: int = 0  # when it was last acquired (a count)


class LayerStager:
    """Stages layers of `stores` (whose expert ranges cover [0, num_experts)) on `device`."""

    def __init__(self, stores: list[MappedStore], num_experts: int, device: torch.device,
                 register: bool = True) -> None:  # fmt: skip
        self.stores = _checked(stores, num_experts)
        self.fmt = self.stores[0].fmt
        self.device = device
        self.num_experts = num_experts
        first = next(iter(self.stores[0].layers.values()))
        self.layer_nbytes = layer_nbytes(self.stores)
        self.slots = [_Slot({n: torch.empty((num_experts, t.shape[1]), device=device,
                                            dtype=_TORCH_DTYPES[t.dtype])
                             for n, t in first.tensors.items()})
                      for _ in range(NUM_SLOTS)]  # fmt: skip
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._registered: list[int] = []
        self.register = register
        self.pinned = self.cuda and register and self._register()
        self.copies = 0  # layers copied (tests and stats)
        self._acquired = 0

    @property
    def memory_bytes(self) -> int:
        """Device memory the two slots hold."""
        return NUM_SLOTS * self.layer_nbytes

    @staticmethod
    def bytes_for(stores: list[MappedStore]) -> int:
        """memory_bytes of a stager of these stores, before one is made."""
        return NUM_SLOTS * layer_nbytes(stores)

    def _register(self) -> bool:
        cudart = torch.cuda.cudart()
        start = time.perf_counter()
        for store in self.stores:
            for address, size in store.regions():
                err = cudart.cudaHostRegister(address, size, REGISTER_READ_ONLY | REGISTER_PORTABLE)
                if int(err) != 0:
                    log.warning("cudaHostRegister of %s failed (%s): prefill streams experts "
                                "from pageable memory", store.dir, err)  # fmt: skip
                    self.close_registrations()
                    return False
                self._registered.append(address)
        log.info("prefill: registered %.1f GiB of the workers' packed experts as pinned memory "
                 "in %.1f s", sum(s.nbytes for s in self.stores) / 2**30,
                 time.perf_counter() - start)  # fmt: skip
        return True

    def _slot_of(self, layer: int) -> _Slot | None:
        return next((s for s in self.slots if s.layer == layer), None)

    def prefetch(self, layer: int, busy: int | None = None) -> None:
        """Start copying `layer` into the slot that does not hold `busy` (the layer computing)."""
        if self._slot_of(layer) is not None:
            return
        free = [s for s in self.slots if busy is None or s.layer != busy]
        slot = min(free, key=lambda s: s.used)  # NOTE: the least recently acquired
        slot.layer = layer
        self.copies += 1
        if not self.cuda:
            self._copy(slot, layer, non_blocking=False)
            return
        with torch.cuda.stream(self.copy_stream):
            if slot.released is not None:
                self.copy_stream.wait_event(slot.released)
            self._copy(slot, layer, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self.copy_stream)

    def _copy(self, slot: _Slot, layer: int, non_blocking: bool) -> None:
        for store in self.stores:
            view = store.layers[layer]
            rows = slice(store.experts.start, store.experts.stop)
            for name, src in view.tensors.items():
                slot.tensors[name][rows].copy_(_as_tensor(src), non_blocking=non_blocking)

    def acquire(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's packed tensors on the device, usable on the current stream (copied first
        if no prefetch did)."""
        slot = self._slot_of(layer)
        if slot is None:
            self.prefetch(layer, busy=None)
            slot = self._slot_of(layer)
        if slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        self._acquired += 1
        slot.used = self._acquired
        return slot.tensors

    def release(self, layer: int) -> None:
        """Every read of the layer's slot is queued on the current stream."""
        slot = self._slot_of(layer)
        if slot is not None and self.cuda:
            slot.released = torch.cuda.Event()
            slot.released.record(torch.cuda.current_stream(self.device))

    def reset(self) -> None:
        """Forget what the slots hold (the weights are copied again when next asked for)."""
        for slot in self.slots:
            slot.layer = None

    def forget(self, layer: int) -> None:
        """Forget one layer (benchmarks: copy it again although it is staged)."""
        slot = self._slot_of(layer)
        if slot is not None:
            slot.layer = None

    def replace_stores(self, stores: list[MappedStore]) -> list[MappedStore]:
        """Stage from these stores from now on (a restarted worker's); returns the old ones."""
        stores = _checked(stores, self.num_experts)
        if {s.fmt for s in stores} != {self.fmt}:
            raise ValueError(f"the workers now hold {stores[0].fmt}, streaming began in {self.fmt}")
        if self.cuda:
            torch.cuda.synchronize(self.device)  # NOTE: no copy may still read the old ones
        self.close_registrations()
        old, self.stores = self.stores, stores
        self.pinned = self.cuda and self.register and self._register()
        self.reset()
        return old

    def close_registrations(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered.clear()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.close_registrations()
        self.slots.clear()


def layer_nbytes(stores: list[MappedStore]) -> int:
    """Bytes of one MoE layer's packed experts over all the stores (a slot holds that much)."""
    return sum(next(iter(s.layers.values())).nbytes for s in stores)


def _checked(stores: list[MappedStore], num_experts: int) -> list[MappedStore]:
    """The stores by expert range; they must hold each expert once, in one format."""
    stores = sorted(stores, key=lambda s: s.experts.start)
    covered = [e for s in stores for e in s.experts]
    if covered != list(range(num_experts)):
        held = [f"{s.experts.start}-{s.experts.stop - 1}" for s in stores]
        raise ValueError(f"the stores hold experts {held}, not each of {num_experts} once")
    if len({s.fmt for s in stores}) != 1:
        raise ValueError(f"the workers' formats differ: {[s.fmt for s in stores]}")
    return stores


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only mapped array (never written through); uint16 as int16."""
    import warnings

    if array.dtype == np.uint16:
        array = array.view(np.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # NOTE: "non-writable": read only
        return torch.from_numpy(array)
