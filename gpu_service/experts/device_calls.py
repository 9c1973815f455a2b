"""The expert calls of a decode step made by the device stream, so the step is one CUDA graph.

Each expert worker gets a ktshm device channel beside its ordinary one, one slot per call of a
step: one per MoE layer, two where it defers experts (decode_graphs.py; ktshm's module docstring
has the bell protocol). Per call j of a step, for each worker w:

    stream: staging [bytes] <- x, ids, weights in the wire dtypes, laid out as slot j's request
            copy staging -> w's request region j             (mapped host memory)
            request_bell j = POSTED                            (cuStreamWriteValue32)
            ... the shared expert runs meanwhile ...
            wait reply_bell j == 1                             (cuStreamWaitValue32)
            copy w's reply region j -> reply[w]; reply_bell = 0; request_bell = IDLE
            routed = sum over w of reply[w]                    [rows_pad, H] float32
    end of the step: done = 1 (channel 0's header)
    host:   before the launch, slot j's request metadata (rows = the live sequences, only when
            they changed) and begin_step; after it, wait_device_step: wakes sleeping workers,
            watches heartbeats, re-posts a dead worker's call to its successor, and, when a
            worker does not come back in time, answers the rest of the step with errors so the
            stream gets through it (ExpertsUnavailable).

`CudaStream` records those operations into the current CUDA stream (under graph capture they
become graph nodes); `HostStream` runs the same sequence from the host, for models on the CPU and
for tests of the protocol without a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ktshm
from gpu_service.experts.errors import ExpertsUnavailable
from ktserve import wire
from ktserve.names import float_dtype
from ktshm import errors as kt

log = logging.getLogger("ktserve.gpu")

POSTED, IDLE = 1, 0
CU_STREAM_WAIT_VALUE_EQ = 0x1


class CudaDriver:
    """The few CUDA driver calls torch does not expose (through ctypes on libcuda)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"the CUDA driver library is not loadable: {exc}") from None
        u64, u32, vp = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
        self._write = self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32", vp, u64, u32, u32)
        self._wait = self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32", vp, u64, u32, u32)
        self._copy = self._fn("cuMemcpyAsync", None, u64, u64, ctypes.c_size_t, vp)
        self._devptr = self._fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer",
                                ctypes.POINTER(u64), vp, u32)  # fmt: skip
        self._error = self.lib.cuGetErrorString
        self._error.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))

    def _fn(self, name: str, fallback: str | None, *argtypes):
        fn = getattr(self.lib, name, None) or (getattr(self.lib, fallback) if fallback else None)
        if fn is None:
            raise RuntimeError(f"the CUDA driver has no {name}")
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self._error(rc, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUDA error {rc} ({(text.value or b'?').decode()})")

    def device_pointer(self, host_address: int) -> int:
        """The device address of registered, mapped host memory."""
        out = ctypes.c_uint64()
        self.check(self._devptr(ctypes.byref(out), host_address, 0), "cuMemHostGetDevicePointer")
        return out.value

    def write32(self, stream: int, address: int, value: int) -> None:
        self.check(self._write(stream, address, value, 0), "cuStreamWriteValue32")

    def wait32(self, stream: int, address: int, value: int) -> None:
        self.check(self._wait(stream, address, value, CU_STREAM_WAIT_VALUE_EQ),
                   "cuStreamWaitValue32")  # fmt: skip

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        self.check(self._copy(dst, src, nbytes, stream), "cuMemcpyAsync")


@dataclass(frozen=True)
class _Slot:
    """Slot j of one worker's device channel: host addresses and, on CUDA, device ones."""

    channel: ktshm.Channel
    index: int
    request_bell: int
    reply_bell: int
    request: int
    reply: int


@dataclass
class _Layout:
    """Where x, ids and weights of rows_pad rows sit in a request region, and the staging
    buffer the stream packs them into."""

    rows_pad: int
    offsets: list[int]
    nbytes: int
    staging: torch.Tensor  # [nbytes] uint8 on the model device
    replies: torch.Tensor  # [workers, rows_pad, H] float32


class CudaStream:
    """Records each operation into the current CUDA stream (graph nodes under capture)."""

    def __init__(self, channels: list[ktshm.Channel]) -> None:
        self.driver = CudaDriver()
        self._device_base = {
            ch.name: self.driver.device_pointer(ch.address) for ch in channels
        }  # fmt: skip
        self._host_base = {ch.name: ch.address for ch in channels}

    def device_address(self, channel: ktshm.Channel, host_address: int) -> int:
        return self._device_base[channel.name] + host_address - self._host_base[channel.name]

    _dev = device_address

    def post(self, slot: _Slot, staging: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        dev = self._dev(slot.channel, slot.request)
        self.driver.copy(stream, dev, staging.data_ptr(), staging.numel())
        self.driver.write32(stream, self._dev(slot.channel, slot.request_bell), POSTED)

    def collect(self, slot: _Slot, out: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self.driver.wait32(stream, self._dev(slot.channel, slot.reply_bell), 1)
        nbytes = out.numel() * out.element_size()
        self.driver.copy(stream, out.data_ptr(), self._dev(slot.channel, slot.reply), nbytes)
        self.driver.write32(stream, self._dev(slot.channel, slot.reply_bell), 0)
        self.driver.write32(stream, self._dev(slot.channel, slot.request_bell), IDLE)

    def end(self, channel: ktshm.Channel) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self.driver.write32(stream, self._dev(channel, channel.done_address), 1)

    @property
    def runs_on_host(self) -> bool:
        return False


class HostStream:
    """The same operations run by the host, in order (CPU models; tests of the protocol).
    recover(slot, exc) is called when a worker dies while the host waits for it."""

    def __init__(self, recover: Callable[[_Slot, Exception], None], timeout_s: float) -> None:
        self.recover, self.timeout_s = recover, timeout_s

    def post(self, slot: _Slot, staging: torch.Tensor) -> None:
        ctypes.memmove(slot.request, staging.data_ptr(), staging.numel())
        slot.channel.ring(slot.index)

    def collect(self, slot: _Slot, out: torch.Tensor) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                reply = slot.channel.await_reply(slot.index, max(deadline - time.monotonic(), 0))
                break
            except (ktshm.PeerDied, ktshm.PeerRestarted) as exc:
                self.recover(slot, exc)
            except ktshm.RemoteError:
                slot.channel.finish(slot.index)
                raise
        rows = reply.arrays[0].shape[0]
        out[:rows].copy_(torch.from_numpy(reply.arrays[0]))
        slot.channel.finish(slot.index)

    def end(self, channel: ktshm.Channel) -> None:
        ctypes.c_uint32.from_address(channel.done_address).value = 1

    @property
    def runs_on_host(self) -> bool:
        return True


class DeviceCalls:
    """The MoE layers' expert calls of decode steps, one device-channel slot per call and worker
    (layers[j]: the MoE layer of slot j; see the module docstring). Built by
    ShmExperts.device_calls."""

    def __init__(self, owner, channels: list[ktshm.Channel], layers: tuple[int, ...],
                 max_rows: int, device: torch.device) -> None:  # fmt: skip
        """owner: the ShmExperts whose workers (same order as channels) serve the calls."""
        self.owner, self.channels, self.layers = owner, channels, layers
        self.max_rows, self.device = max_rows, device
        self.hidden, self.top_k = owner.hidden_size, owner.top_k
        self.wire_dtype = owner.config.wire_dtype
        self.timeout_s = owner.config.worker_timeout_s
        self._arg_dtypes = (float_dtype(self.wire_dtype).torch(), torch.int32, torch.float32)
        self.slots = [
            [_Slot(ch, j, *ch.device_slot(j)) for j in range(len(layers))] for ch in channels
        ]
        self.kernels = None
        self._stamps: torch.Tensor | None = None
        if device.type == "cuda":
            self.stream: CudaStream | HostStream = CudaStream(channels)
            if owner.config.device_handoff == "kernels":
                try:
                    from gpu_service.experts.device_kernels import KernelHandoff
                except ImportError as exc:
                    log.warning("device hand-off by kernels needs Triton (%s): using memops", exc)
                else:
                    self.kernels = KernelHandoff(self._arg_dtypes[0])
            if self.kernels is not None:
                # [worker, slot, post|collect]: each launch site's counter (device_kernels.py)
                self._counters = torch.zeros((len(channels), len(layers), 2), dtype=torch.int32,
                                             device=device)  # fmt: skip
                if owner.config.handoff_stamps:  # [worker, slot, 6] (device_kernels.py: STAMPS)
                    self._stamps = torch.zeros((len(channels), len(layers), 6),
                                               dtype=torch.int64, device=device)  # fmt: skip
                dev = self.stream.device_address
                # per worker and slot, the device addresses of (request, request_bell, reply,
                # reply_bell): fixed for the channels' lifetime
                self._device_slots = [
                    [tuple(dev(s.channel, a) for a in (s.request, s.request_bell, s.reply,
                                                       s.reply_bell)) for s in slots]
                    for slots in self.slots
                ]  # fmt: skip
        else:
            self.stream = HostStream(self._recover_on_host, self.timeout_s)
        self._layouts: dict[int, _Layout] = {}
        self._announced: tuple[int, int] | None = None
        for ch in channels:
            ch.reset_device()

    # ------------------------------------------------------------------ per bucket
    def layout(self, rows_pad: int) -> _Layout:
        """The request layout of rows_pad rows (made once; allocate before a capture)."""
        found = self._layouts.get(rows_pad)
        if found is not None:
            return found
        if not 1 <= rows_pad <= self.max_rows:
            raise ValueError(f"{rows_pad} rows; the device channels hold 1..{self.max_rows}")
        offsets = self.channels[0].device_layout(0, wire.KIND_MOE, self.layers[0],
                                                 self._specs(rows_pad))  # fmt: skip
        nbytes = offsets[2] + rows_pad * self.top_k * 4
        staging = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        replies = torch.zeros((len(self.channels), rows_pad, self.hidden), dtype=torch.float32,
                              device=self.device)  # fmt: skip
        found = _Layout(rows_pad, offsets, nbytes, staging, replies)
        self._layouts[rows_pad] = found
        self._announced = None  # slot 0 was just laid out
        return found

    def _specs(self, rows: int) -> list:
        return [((rows, self.hidden), self.wire_dtype), ((rows, self.top_k), wire.IDS_DTYPE),
                ((rows, self.top_k), wire.WEIGHTS_DTYPE)]  # fmt: skip

    def begin_step(self, rows_pad: int, rows: int) -> None:
        """Host, before the step's device work is launched: announce `rows` live rows of
        rows_pad in every slot (when that changed), and clear the done word."""
        if self._announced != (rows_pad, rows):
            specs = self._specs(rows_pad)
            for ch in self.channels:
                for j, layer in enumerate(self.layers):
                    ch.device_layout(j, wire.KIND_MOE, layer, specs, rows)
            self._announced = (rows_pad, rows)
        for ch in self.channels:
            ch.begin_step()

    # ------------------------------------------------------------------ on the stream
    def call(self, j: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Post MoE layer j's call (x [rows_pad, H], ids/weights [rows_pad, k]) to every worker."""
        lay = self._layouts[x.shape[0]]
        if self.kernels is not None:
            x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
            for w, slots in enumerate(self._device_slots):
                request, request_bell, _, _ = slots[j]
                stamps = prev = None
                if self._stamps is not None:
                    stamps = self._stamps[w, j]
                    prev = self._stamps[w, j - 1] if j > 0 else None
                self.kernels.post(request, lay.offsets, request_bell, self._counters[w, j, 0],
                                  x, ids, weights, stamps, prev)  # fmt: skip
            return
        staging = lay.staging
        for offset, tensor, dtype in zip(lay.offsets, (x, ids, weights), self._arg_dtypes):
            nbytes = tensor.numel() * dtype.itemsize
            staging[offset : offset + nbytes].view(dtype).view(tensor.shape).copy_(tensor)
        for slots in self.slots:
            self.stream.post(slots[j], staging)

    def collect(self, j: int, routed: torch.Tensor) -> None:
        """Wait for layer j's replies and put their sum into routed [rows_pad, H] float32."""
        lay = self._layouts[routed.shape[0]]
        if self.kernels is not None:
            if not routed.is_contiguous():
                raise ValueError("routed must be contiguous")
            for w, slots in enumerate(self._device_slots):
                _, request_bell, reply, reply_bell = slots[j]
                stamps = None if self._stamps is None else self._stamps[w, j]
                self.kernels.collect(reply, reply_bell, request_bell, self._counters[w, j, 1],
                                     routed, accumulate=w > 0, stamps=stamps)  # fmt: skip
            return
        if self.stream.runs_on_host:
            lay.replies.zero_()  # NOTE: the host copies only the announced rows
            try:
                for w, slots in enumerate(self.slots):
                    self.stream.collect(slots[j], lay.replies[w])
            except BaseException:
                for ch in self.channels:  # the step is over: no call stays posted
                    ch.reset_device()
                raise
        else:
            for w, slots in enumerate(self.slots):
                self.stream.collect(slots[j], lay.replies[w])
        if len(self.slots) == 1:
            routed.copy_(lay.replies[0])
        else:
            torch.sum(lay.replies, dim=0, out=routed)

    def handoff_stamps(self) -> torch.Tensor | None:
        """The GPU's hand-off stamps so far, [worker, slot, 6] int64 nanoseconds and counts (on
        the host; device_kernels.py's STAMPS), or None where they are not kept."""
        return None if self._stamps is None else self._stamps.cpu()

    def end_step(self) -> None:
        self.stream.end(self.channels[0])

    # ------------------------------------------------------------------ host, after launch
    def wait(self) -> None:
        """Host, after the launch: see the step through (module docstring); raises
        ExpertsUnavailable when the workers failed it (the device has finished it then)."""
        if self.stream.runs_on_host:
            return
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            result = ktshm.wait_device_step(self.channels, max(deadline - time.monotonic(), 0))
            if result is None:
                self.owner.stats.wait_s += time.perf_counter() - start
                return
            status, c, slot = result
            worker = self.owner.workers[c]
            if status == kt.EREMOTE:
                try:
                    self.channels[c].device_reply(slot)
                except ktshm.RemoteError as exc:
                    name = wire.STATUS_NAMES.get(exc.status, exc.status)
                    raise ExpertsUnavailable(
                        f"expert worker {worker.address} failed: {name}: {exc.message}"
                    ) from exc
                raise ExpertsUnavailable(f"expert worker {worker.address} failed a call")
            if status in (kt.EPEER_DIED, kt.EPEER_RESTARTED):
                log.warning("expert worker %s died mid-step; waiting for it to come back",
                            worker.address)  # fmt: skip
                try:
                    worker.attach(deadline)
                except ExpertsUnavailable:
                    self._abandon_step()
                    raise
                self.channels[c].resend_claimed()
                continue
            self._abandon_step()
            raise ExpertsUnavailable(
                f"expert worker {worker.address} gave no answer in {self.timeout_s:.0f} s"
            )

    def wake(self) -> None:
        """Host, right after a launch, where it has other work before wait(): until every
        worker has the step's first call, waking one that slept across the step's end (the
        device cannot; wait() does it for the later calls). A failure is left for wait()."""
        if not self.stream.runs_on_host:
            ktshm.wait_device_step(self.channels, self.timeout_s, until_called=True)

    def _abandon_step(self) -> None:
        """Answer every call the device still makes this step with an error, then reset."""
        for ch in self.channels:
            ch.resend_claimed()
        ktshm.wait_device_step(self.channels, 60.0, fail_status=kt.EPEER_DIED)
        torch.cuda.synchronize(self.device)
        for ch in self.channels:
            ch.reset_device()

    def _recover_on_host(self, slot: _Slot, exc: Exception) -> None:
        worker = self.owner.workers[self.channels.index(slot.channel)]
        if isinstance(exc, ktshm.PeerDied):
            log.warning("expert worker %s died; waiting for it to come back", worker.address)
            worker.attach(time.monotonic() + self.timeout_s)
        slot.channel.resend_claimed()

    def close(self) -> None:
        self._layouts.clear()


def region_bytes(max_rows: int, hidden: int, top_k: int) -> int:
    """A device slot's region: the request (x at most float32, ids, weights) and the reply."""
    return max_rows * hidden * 4 + 2 * max_rows * top_k * 4 + 3 * 64
