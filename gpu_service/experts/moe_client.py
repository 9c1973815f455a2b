"""Routed experts on CPU expert workers, reached through one ktshm channel per worker.

Per MoE layer and step (protocol of ktserve/wire.py):

    submit: x [T, H] (device) ──copy──▶ each worker's request slot (x, ids, weights); commit
            (the model computes its shared expert on the GPU meanwhile)
    wait:   each worker's reply y_w [T, H] float32 ──sum──▶ y [T, H] ──copy──▶ device

Each worker holds an expert id range; ids it does not hold are skipped there, so the replies are
partial sums and add up to the whole. A worker that dies is waited for (re-attached over gRPC as
soon as it is back, its in-flight call resent) up to `worker_timeout_s`, then ExpertsUnavailable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch

import ktshm
from gpu_service.config import ExpertClientConfig
from gpu_service.experts.device_calls import DeviceCalls, region_bytes
from gpu_service.experts.errors import ExpertsUnavailable
from ktserve import wire
from ktserve.names import float_dtype
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import worker_channel

log = logging.getLogger("ktserve.gpu")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
             grpc.StatusCode.DEADLINE_EXCEEDED)  # fmt: skip


PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped

# A restarted worker is reconnected to within a second: gRPC's default backoff grows to minutes,
# longer than requests wait for a worker (--worker-timeout).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class _Worker:
    """One expert worker: its gRPC stub and the ktshm channel this service created for it."""

    def __init__(self, address: str, channel: ktshm.Channel, token: str | None = None) -> None:
        self.address = address
        self.grpc_channel = worker_channel(address, token, RECONNECT_OPTIONS)
        self.stub = pb_grpc.ExpertServiceStub(self.grpc_channel)
        self.channel = channel
        self.device_channels: list[ktshm.Channel] = []
        self.info: pb.WorkerInfo | None = None

    def attach(self, deadline: float) -> None:
        """Attach the channels, retrying while the worker is unreachable or still loading."""
        while True:
            left = deadline - time.monotonic()
            try:
                for channel in (self.channel, *self.device_channels):
                    self.stub.Attach(
                        pb.AttachRequest(channel_name=channel.name), timeout=max(left, 0.1)
                    )
                self.info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=max(left, 0.1))
                return
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() >= deadline:
                    raise ExpertsUnavailable(
                        f"expert worker {self.address}: {exc.code().name}: {exc.details()}"
                    ) from exc
            time.sleep(0.05)  # NOTE: a restarting worker takes seconds; poll its gRPC port

    def close(self) -> None:
        for channel in (self.channel, *self.device_channels):
            channel.close()
        self.grpc_channel.close()


class ShmExperts:
    """RoutedExperts backed by expert worker processes (see module docstring)."""

    def __init__(self, config: ExpertClientConfig, hidden_size: int, top_k: int,
                 max_tokens: int, device: torch.device | str = "cpu") -> None:  # fmt: skip
        """max_tokens: most tokens in one MoE call (the channels' regions hold that many)."""
        if not config.workers:
            raise ValueError("at least one expert worker address is needed")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.config = config
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        # x [T, H] in the wire dtype, ids [T, k] int32, weights [T, k] float32
        self._arg_dtypes = (float_dtype(config.wire_dtype).torch(), torch.int32, torch.float32)
        itemsize = self._arg_dtypes[0].itemsize
        region = max_tokens * (hidden_size * 4 + top_k * 8) + 3 * 64
        region = max(region, max_tokens * hidden_size * itemsize + 4096)
        channel_config = ktshm.ChannelConfig(
            num_slots=config.num_slots, region_bytes=region, spin_us=config.spin_us,
            default_timeout_s=config.worker_timeout_s,
        )  # fmt: skip
        self.workers: list[_Worker] = []
        self._registered: list[int] = []
        deadline = time.monotonic() + config.worker_timeout_s
        try:
            for address in config.workers:
                worker = _Worker(address, ktshm.Channel.create(channel_config), config.token)
                self.workers.append(worker)
                self._pin(worker.channel)
                worker.attach(deadline)
        except BaseException:
            self.close()
            raise
        self.stats = MoEStats()
        self.broken: set[str] = set()  # workers whose channel is being replaced (corrupt)
        self.on_round_trip: Callable[[float], None] | None = None
        self._staging: torch.Tensor | None = None  # [bytes] uint8 on the device

    def _pin(self, channel: ktshm.Channel, required: bool = False) -> None:
        """Register the segment as pinned memory mapped into the device's address space, so
        GPU copies (and a device channel's stream writes and waits) go straight to it."""
        if self.device.type != "cuda" or not (self.config.pin_memory or required):
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(channel.address, channel.size, PORTABLE_MAPPED)
        if int(err) != 0:
            if required:
                raise RuntimeError(f"cudaHostRegister of channel {channel.name} failed: {err}")
            log.warning("cudaHostRegister failed (%s); copies will be staged", err)
            return
        self._registered.append(channel.address)

    def device_calls(self, layers: tuple[int, ...], max_rows: int) -> DeviceCalls:
        """A device channel per worker, one slot per entry of `layers` (a call's MoE layer), for
        decode steps of up to max_rows sequences whose expert calls the device stream makes
        (device_calls.py)."""
        region = region_bytes(max_rows, self.hidden_size, self.top_k)
        config = ktshm.ChannelConfig(
            num_slots=len(layers), region_bytes=region, spin_us=self.config.spin_us,
            default_timeout_s=self.config.worker_timeout_s,
        )  # fmt: skip
        deadline = time.monotonic() + self.config.worker_timeout_s
        channels = []
        for worker in self.workers:
            channel = ktshm.Channel.create(config, device=True)
            worker.device_channels.append(channel)
            channels.append(channel)
            self._pin(channel, required=True)
            worker.attach(deadline)
        return DeviceCalls(self, channels, layers, max_rows, self.device)

    def submit(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> PendingShm:
        num_tokens = x.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"{num_tokens} tokens in one MoE call, the channels hold {self.max_tokens}"
            )
        start = time.perf_counter()
        wire_dtype = self.config.wire_dtype
        k = ids.shape[1]
        specs = [
            ((num_tokens, self.hidden_size), wire_dtype),
            ((num_tokens, k), wire.IDS_DTYPE),
            ((num_tokens, k), wire.WEIGHTS_DTYPE),
        ]
        calls, first = [], None
        for worker in self.workers:
            msg = self._begin(worker, layer, specs, num_tokens)
            if first is None:
                self._packed(msg, (x, ids, weights), self._arg_dtypes)
            else:
                np.copyto(msg.payload, first)  # the same bytes: a host copy, not another transfer
            first = msg.payload
            calls.append((worker, worker.channel.commit(msg)))
        self.stats.transfer_s += time.perf_counter() - start
        return PendingShm(self, layer, calls, num_tokens, start)

    def _begin(self, worker: _Worker, layer: int, specs: list, num_tokens: int) -> ktshm.Message:
        """The worker channel's next request slot. One that an abandoned call holds (the worker
        is still computing it) frees when the worker replies: waited for, up to the timeout. A
        channel found in an impossible state (a slot held by no call of ours: its memory was
        overwritten) is replaced by a new one, attached over gRPC, before the call goes out."""
        deadline = time.monotonic() + self.config.worker_timeout_s
        while True:
            try:
                return worker.channel.begin(wire.KIND_MOE, layer, specs, num_tokens)
            except ktshm.ChannelCorrupt as exc:
                if worker.channel.inflight():
                    raise ExpertsUnavailable(
                        f"expert worker {worker.address}: channel corrupt with calls in flight "
                        f"({exc})"
                    ) from exc
                log.error("expert worker %s: channel %s is corrupt (%s); replacing it",
                          worker.address, worker.channel.name, exc)  # fmt: skip
                self._replace_channel(worker)
                continue
            except ktshm.ChannelFull:
                if len(worker.channel.inflight()) >= worker.channel.num_slots:
                    raise  # every slot holds a call someone will wait for: a caller's bug
                if time.monotonic() >= deadline:
                    raise ExpertsUnavailable(
                        f"expert worker {worker.address} did not finish an abandoned call in "
                        f"{self.config.worker_timeout_s:.0f} s"
                    ) from None
            time.sleep(20e-6)  # NOTE: the slot frees as soon as the worker replies

    def _replace_channel(self, worker: _Worker) -> None:
        old = worker.channel
        self.broken.add(worker.address)
        worker.channel = ktshm.Channel.create(old.config)
        try:
            self._pin(worker.channel)
            worker.attach(time.monotonic() + self.config.worker_timeout_s)
        finally:
            self._unpin(old)
            old.close()
        self.broken.discard(worker.address)

    def _unpin(self, channel: ktshm.Channel) -> None:
        if channel.address in self._registered:
            torch.cuda.cudart().cudaHostUnregister(channel.address)
            self._registered.remove(channel.address)

    def _packed(self, msg: ktshm.Message, tensors: tuple[torch.Tensor, ...],
                dtypes: tuple[torch.dtype, ...]) -> None:  # fmt: skip
        """Lay the arrays out on the device as they sit in the slot, converted to the wire dtypes,
        then copy them in one go (one device-to-host transfer and one synchronization instead of
        one per array)."""
        payload = msg.payload
        size = payload.nbytes
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(max(size, 1 << 16), dtype=torch.uint8, device=self.device)
        staging = self._staging[:size]
        base = payload.ctypes.data
        for view, tensor, dtype in zip(msg.arrays, tensors, dtypes):
            offset = view.ctypes.data - base
            staging[offset : offset + view.nbytes].view(dtype).view(tensor.shape).copy_(tensor)
        torch.from_numpy(payload).copy_(staging)

    def _recv(self, worker: _Worker, seq: int) -> ktshm.Message:
        deadline = time.monotonic() + self.config.worker_timeout_s
        while True:
            try:
                reply = worker.channel.recv(seq, timeout=max(deadline - time.monotonic(), 0.0))
                self.broken.discard(worker.address)
                return reply
            except ktshm.PeerDied:
                log.warning("expert worker %s died; waiting for it to come back", worker.address)
                worker.attach(deadline)
                worker.channel.resend_inflight()
            except ktshm.PeerRestarted:
                worker.channel.resend_inflight()
            except ktshm.ChannelTimeout as exc:
                raise ExpertsUnavailable(
                    f"expert worker {worker.address} gave no answer in "
                    f"{self.config.worker_timeout_s:.0f} s"
                ) from exc
            except ktshm.RemoteError as exc:
                status = wire.STATUS_NAMES.get(exc.status, exc.status)
                raise ExpertsUnavailable(
                    f"expert worker {worker.address} failed: {status}: {exc.message}"
                ) from exc
            if time.monotonic() >= deadline:
                raise ExpertsUnavailable(f"expert worker {worker.address} did not come back")

    def alive(self) -> dict[str, bool]:
        """Each worker: its channel is sound and its consumer's heartbeat fresh."""
        return {w.address: w.address not in self.broken and w.channel.peer_alive()
                for w in self.workers}  # fmt: skip

    def close(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered.clear()
        for worker in self.workers:
            worker.close()
        self.workers.clear()


@dataclass
class MoEStats:
    """Seconds spent, summed over calls: copying to the channels, and waiting for replies."""

    transfer_s: float = 0.0
    wait_s: float = 0.0
    calls: int = 0


class PendingShm:
    def __init__(self, owner: ShmExperts, layer: int, calls: list, num_tokens: int,
                 submitted: float) -> None:  # fmt: skip
        self.owner = owner
        self.submitted = submitted
        self.layer = layer
        self.calls = calls
        self.num_tokens = num_tokens

    def abandon(self) -> None:
        """Give up on the replies (an error elsewhere): their slots are freed when they come."""
        for worker, seq in self.calls:
            worker.channel.abandon(seq)

    def wait(self) -> torch.Tensor:
        owner = self.owner
        start = time.perf_counter()
        total: torch.Tensor | None = None
        done = 0
        try:
            for worker, seq in self.calls:
                reply = owner._recv(worker, seq)
                try:
                    partial = torch.from_numpy(reply.arrays[0])  # [T, H] float32, slot view
                    part = partial.to(owner.device, copy=True)
                    total = part if total is None else total.add_(part)
                finally:
                    worker.channel.release(seq)
                done += 1
        except BaseException:
            # NOTE: free the slots of the replies nobody will read, or the ring fills up.
            for worker, seq in self.calls[done:]:
                worker.channel.abandon(seq)
            raise
        end = time.perf_counter()
        owner.stats.wait_s += end - start
        owner.stats.calls += 1
        if owner.on_round_trip is not None:
            owner.on_round_trip(end - self.submitted)
        return total
