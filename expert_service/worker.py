"""The expert worker: holds a shard, runs MoE calls arriving on its attached ktshm channels.

Each attached channel has one thread: take a request, run the kernel straight into the reply
slot (zero copy), publish. The kernel's thread pool is shared, so calls run one at a time.
A malformed call gets an error reply on that call and the worker keeps serving.

    EMPTY --load--> LOADING --> SERVING --drain--> DRAINING --> (exit)
              \\--load fails--> EMPTY
"""

from __future__ import annotations

import enum
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ktshm
from expert_service.call_timing import PARTS, CallTimings
from expert_service.config import WorkerConfig
from expert_service.expert_shard import ExpertShard, LoadProgress
from expert_service.kernels import MoEKernel
from expert_service.metrics import CallCounts, WorkerMetrics
from expert_service.shard import load_shard
from ktserve import envs, shared_store, wire

log = logging.getLogger("ktserve.expert")

POLL_S = 0.2  # how often an idle channel thread looks at the stop flag
IDLE_GAP_S = 0.005  # gaps between calls counted as idle (longer: between steps or requests)
PRODUCER_GRACE_S = 10.0  # a GPU service whose heartbeat stalls this long is gone (see below)
PRODUCER_POLL_S = 0.05
# An experiment's switch (tests of the device hand-off under timing pressure): ktserve/envs.py
REPLY_DELAY_ENV = envs.WORKER_REPLY_DELAY_US.name
REPLY_DELAY_SEED_ENV = envs.WORKER_REPLY_DELAY_SEED.name


class WorkerState(enum.IntEnum):
    EMPTY = 1
    LOADING = 2
    SERVING = 3
    DRAINING = 4


class WorkerStateError(RuntimeError):
    """The call is not allowed in the worker's current state (gRPC FAILED_PRECONDITION)."""


class BadCall(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Serving:
    """What one channel thread keeps about its calls; written by that thread only."""

    counts: CallCounts
    timings: CallTimings | None
    replied: int = 0  # replies published (counts.calls catches up once they are counted)
    in_flight: int = 0
    calls_completed: int = 0
    answered_at: float = 0.0  # perf_counter when the last call (of any kind) was answered
    answered_layer: int = -1  # the layer of the last MoE call answered (-1: none yet)


def count_idle_gap(counts: CallCounts, answered_layer: int, layer: int, gap: float) -> None:
    """Counts the caller's time before a call for `layer` (`gap` seconds from the reply to the
    call before it, which was for `answered_layer`, -1 if none) as idle when it is under
    IDLE_GAP_S, and as inner idle too when `layer` is the later one (two MoE layers of a step)."""
    if gap < IDLE_GAP_S:  # the caller's time between two layers' calls, hand-off included
        counts.idle_seconds += gap
        counts.idle_gaps += 1
        if layer > answered_layer >= 0:
            counts.inner_idle_seconds += gap
            counts.inner_idle_gaps += 1


@dataclass
class _Attached:
    channel: ktshm.Channel
    thread: threading.Thread
    stop: threading.Event
    serving: _Serving


class ExpertWorker:
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or WorkerMetrics()
        self.kernel = MoEKernel(config.num_threads, config.isa)
        self.metrics.set_kernel(self.kernel.isa, self.kernel.num_threads)
        self.shard: ExpertShard | None = None
        self.state = WorkerState.EMPTY
        self._lock = threading.Lock()  # state, shard, channels
        self._kernel_lock = threading.Lock()
        self._channels: dict[str, _Attached] = {}
        self._activations: dict[int, np.ndarray] = {}  # layer -> its counts, the kernel adds
        self._serving: dict[str, _Serving] = {}  # by channel name, kept after detach
        # GetStats waits for every published reply to be counted; a channel thread notifies
        # only while someone waits (NOTE: it counts, then reads the waiters; a waiter registers,
        # then checks the counts: under the GIL one of the two sees the other).
        self._stats_cv = threading.Condition()
        self._stats_waiters = 0
        self.metrics.in_flight.set_function(lambda: self.in_flight)
        self._reply_delay_s = envs.WORKER_REPLY_DELAY_US.read() * 1e-6
        if self._reply_delay_s < 0:
            raise ValueError(f"{REPLY_DELAY_ENV} must be >= 0 microseconds")
        self._reply_delay_rng = random.Random(envs.WORKER_REPLY_DELAY_SEED.read())
        if self._reply_delay_s:
            log.warning("%s: every MoE reply is held back 0..%.0f us (an experiment)",
                        REPLY_DELAY_ENV, self._reply_delay_s * 1e6)  # fmt: skip
        self.drained = threading.Event()
        self._parent = os.getppid()
        self.exit_requested = threading.Event()

    # ------------------------------------------------------------------------------- model
    def load(
        self,
        model_dir: str,
        experts: range | None,
        weight_format: str,
        progress: LoadProgress | None = None,
        intermediate: range | None = None,
    ) -> ExpertShard:
        """intermediate: the rows of each expert's intermediate dimension to hold (default: the
        worker's --intermediate-rows, else all)."""
        intermediate = intermediate if intermediate is not None else self.config.intermediate_range
        with self._lock:
            if self.state != WorkerState.EMPTY:
                raise WorkerStateError(
                    f"a model is already {self.state.name.lower()} ({self._describe()}); "
                    "start another worker for another model or shard"
                )
            self.state = WorkerState.LOADING
        try:
            shard = load_shard(
                model_dir, experts, weight_format,
                pack_threads=self.config.num_threads, progress=progress,
                share=self.config.share_experts, intermediate=intermediate,
            )  # fmt: skip
        except BaseException:
            with self._lock:
                self.state = WorkerState.EMPTY
            raise
        self.metrics.set_shard(shard)
        self._activations = self.metrics.activations.layer_rows()
        with self._lock:
            self.shard = shard
            self.state = WorkerState.SERVING
        log.info("loaded %s", self._describe())
        return shard

    def model_name(self) -> str:
        """Its metrics' model_name label: --served-model-name, else the loaded checkpoint's name
        as `ktserve serve` names it ("" before one is loaded)."""
        from ktserve.gguf.files import model_name

        if self.config.served_model_name:
            return self.config.served_model_name
        shard = self.shard
        return model_name(shard.source_dir) if shard is not None else ""

    def _describe(self) -> str:
        s = self.shard
        if s is None:
            return "no model"
        rows = ""
        if s.intermediate is not None:
            rows = (f" (intermediate rows {s.rows.start}-{s.rows.stop - 1} of "
                    f"{s.spec.moe_intermediate_size})")  # fmt: skip
        return (
            f"{s.source_dir}: experts {s.experts.start}-{s.experts.stop - 1} of "
            f"{s.spec.num_experts}{rows}, {len(s.layers)} MoE layers, {s.weight_format}, "
            f"{s.nbytes / 2**30:.2f} GiB"
        )

    # ---------------------------------------------------------------------------- channels
    def attach(self, name: str) -> int:
        with self._lock:
            if self.state != WorkerState.SERVING:
                raise WorkerStateError(
                    f"the worker is {self.state.name.lower()}: it takes channels once a model "
                    "is loaded and until it drains"
                )
            current = self._channels.get(name)
            if current is not None and current.thread.is_alive():
                return current.channel.epoch
            channel = ktshm.Channel.attach(name, ktshm.ChannelConfig(spin_us=self.config.spin_us))
            stop = threading.Event()
            samples = self.config.call_timing_samples
            serving = _Serving(self.metrics.new_call_counts(),
                               CallTimings(samples) if samples else None)  # fmt: skip
            thread = threading.Thread(
                target=self._serve_channel, args=(channel, stop, serving), name=f"ktshm-{name}",
                daemon=True,
            )  # fmt: skip
            self._channels[name] = _Attached(channel, thread, stop, serving)
            self._serving[f"{name}#{channel.epoch}"] = serving
            thread.start()
        log.info("attached channel %s (epoch %d)", name, channel.epoch)
        return channel.epoch

    def detach(self, name: str, timeout: float = 10.0) -> None:
        with self._lock:
            attached = self._channels.pop(name, None)
        if attached is None:
            raise KeyError(f"channel {name!r} is not attached to this worker")
        attached.stop.set()
        attached.thread.join(timeout)

    def channel_names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, a in self._channels.items() if a.thread.is_alive())

    def call_timing_parts(self) -> dict[str, np.ndarray] | None:
        """The recorded calls' parts (call_timing.PARTS, ns), channel after channel; None when
        the worker keeps none (--call-timing-samples 0)."""
        if not self.config.call_timing_samples:
            return None
        with self._lock:
            rings = [s.timings for s in self._serving.values() if s.timings is not None]
        per_ring = [ring.parts() for ring in rings]
        return {
            part: np.concatenate([p[part] for p in per_ring] or [np.zeros(0, np.int64)])
            for part in PARTS
        }

    def _serve_channel(
        self, channel: ktshm.Channel, stop: threading.Event, serving: _Serving
    ) -> None:
        producer_died = False
        try:
            while True:
                draining = self.state == WorkerState.DRAINING
                if stop.is_set():
                    return
                try:
                    req = channel.recv_request(timeout=0.05 if draining else POLL_S)
                except ktshm.ChannelTimeout:
                    if draining:
                        return  # nothing left queued on this channel
                    continue
                except ktshm.PeerDied:
                    if self._producer_comes_back(channel, stop):
                        log.warning("channel %s: the GPU service's heartbeat stalled, then came "
                                    "back; serving it on", channel.name)  # fmt: skip
                        continue
                    log.warning("channel %s: the GPU service is gone; detaching", channel.name)
                    producer_died = True
                    return
                except ktshm.PeerRestarted:
                    log.warning("channel %s: another worker attached; detaching", channel.name)
                    return
                except ktshm.MalformedMessage as exc:
                    self.metrics.errors.labels(status="BAD_MESSAGE").inc()
                    log.warning("channel %s: %s", channel.name, exc)
                    continue
                self.kernel.wake()  # NOTE: sleeping pool threads wake while we dispatch
                self._execute(channel, req, serving)
        finally:
            # NOTE: a killed GPU service cannot unlink its segments: the consumer does, once the
            # producer's heartbeat shows it gone (waited for when our parent died with it).
            orphaned = os.getppid() != self._parent
            wait_s = 2 * channel.config.peer_timeout_s if orphaned and not producer_died else 0.0
            try:
                if channel.unlink_if_producer_gone(wait_s):
                    log.info("channel %s: unlinked (its producer is gone)", channel.name)
            except ktshm.KtshmError:
                pass
            channel.close()
            with self._lock:
                mine = self._channels.get(channel.name)
                if mine is not None and mine.channel is channel:
                    del self._channels[channel.name]

    @staticmethod
    def _producer_comes_back(channel: ktshm.Channel, stop: threading.Event) -> bool:
        """After PeerDied: a GPU service starved of CPU (its heartbeat thread not run for over
        peer_timeout_s) is alive all the same. Serve it on if its heartbeat resumes within
        PRODUCER_GRACE_S; only then is it dead and its segment ours to unlink."""
        deadline = time.monotonic() + PRODUCER_GRACE_S
        while time.monotonic() < deadline:
            if channel.peer_alive():
                return True
            if stop.wait(PRODUCER_POLL_S):
                return False
        return False

    # ------------------------------------------------------------------------------ calls
    def _execute(self, channel: ktshm.Channel, req: ktshm.Message, serving: _Serving) -> None:
        start = time.perf_counter()
        serving.in_flight = 1
        kernel_ran = False
        try:
            if req.kind == wire.KIND_PING:
                channel.reply(req, [])
                return
            self._moe_call(channel, req, start, serving)
            kernel_ran = True
        except BadCall as exc:
            self.metrics.errors.labels(status=wire.STATUS_NAMES[exc.status]).inc()
            channel.reply_error(req, exc.status, str(exc))
        except Exception as exc:  # the kernel or a bug: answer, log, keep serving
            log.exception("MoE call %d on %s failed", req.seq, channel.name)
            self.metrics.errors.labels(status="INTERNAL").inc()
            channel.reply_error(req, wire.STATUS_INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if serving.timings is not None and not kernel_ran:
                serving.timings.skip()
            serving.in_flight = 0
            serving.calls_completed += 1
            serving.answered_at = time.perf_counter()

    def _hold_reply(self) -> None:
        """REPLY_DELAY_ENV: spin a random share of the delay (a sleep would round it up)."""
        until = time.perf_counter() + self._reply_delay_rng.uniform(0, self._reply_delay_s)
        while time.perf_counter() < until:
            pass

    def _moe_call(
        self, channel: ktshm.Channel, req: ktshm.Message, start: float, serving: _Serving
    ) -> None:
        if req.kind not in (wire.KIND_MOE, wire.KIND_MOE_BF16_OUT):
            raise BadCall(wire.STATUS_BAD_REQUEST, f"unknown message kind {req.kind}")
        shard = self.shard
        if shard is None:
            raise BadCall(wire.STATUS_NO_MODEL, "no model is loaded on this worker")
        packed = shard.layers.get(req.layer)
        if packed is None:
            raise BadCall(
                wire.STATUS_BAD_LAYER,
                f"layer {req.layer} has no routed experts (MoE layers: "
                f"{shard.spec.moe_layers[0]}..{shard.spec.moe_layers[-1]})",
            )
        x, ids, weights = _check_arrays(req, shard.spec.hidden_size)
        num_experts = shard.spec.num_experts
        if shard.holds_all:
            local = ids  # NOTE: the kernel rejects ids outside [-1, E) before it writes
        else:
            _check_ids(ids, num_experts)
            local = shard.localize(ids)
        (out,) = channel.begin_reply(req, [(x.shape, wire.OUT_DTYPES[req.kind])])
        with self._kernel_lock:
            kernel_start = time.perf_counter()
            try:
                self.kernel.forward(packed, x, local, weights, out, self._activations[req.layer])
            except ValueError:
                _check_ids(ids, num_experts)
                raise
            kernel_end = time.perf_counter()
            forward = self.kernel.last_forward()  # (start ns, end ns, experts run)
        if self._reply_delay_s:
            self._hold_reply()
        channel.commit_reply(req)
        published = time.perf_counter()
        serving.replied += 1
        # NOTE: what follows is counted after the reply is out, while the caller computes its
        # next layer: a few additions (a thread of its own was tried: it held the GIL when the
        # next request came, on the GPU host).
        if serving.timings is not None:
            serving.timings.record(channel.call_stamps(), forward[:2])
        counts = serving.counts
        count_idle_gap(counts, serving.answered_layer, req.layer, start - serving.answered_at)
        serving.answered_layer = req.layer
        counts.add(req.layer, x.shape[0], forward[2] * shard.expert_nbytes, published - start)
        phases = counts.phase_seconds
        phases[0] += kernel_start - start
        phases[1] += kernel_end - kernel_start
        phases[2] += published - kernel_end
        phases[3] += time.perf_counter() - published
        if self._stats_waiters:
            with self._stats_cv:
                self._stats_cv.notify_all()

    def wait_for_stats(self, timeout: float = 1.0) -> bool:
        """Returns once every call replied so far is in the metrics (a client may ask for stats
        right after its last reply, before the serving thread has counted that call); False if
        that took longer than timeout."""
        with self._lock:
            serving = list(self._serving.values())
        targets = [(s, s.replied) for s in serving]
        with self._stats_cv:
            self._stats_waiters += 1
            try:
                return self._stats_cv.wait_for(
                    lambda: all(s.counts.calls >= n for s, n in targets), timeout
                )
            finally:
                self._stats_waiters -= 1

    # ------------------------------------------------------------------------------ drain
    def drain(self, timeout: float | None = None) -> int:
        """Answer what is queued, stop every channel, and return the calls completed."""
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        with self._lock:
            self.state = WorkerState.DRAINING
            threads = [a.thread for a in self._channels.values()]
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for a in self._channels.values():
                a.stop.set()
        self.drained.set()
        return self.calls_completed

    def close(self) -> None:
        with self._lock:
            attached = list(self._channels.values())
            self._channels.clear()
        for a in attached:
            a.stop.set()
        for a in attached:
            a.thread.join(5)
        self.kernel.close()
        store = self.shard.store if self.shard is not None else None
        if store is not None and shared_store.is_store_name(Path(store.dir).name):
            shared_store.remove(Path(store.dir))  # NOTE: ours: a convert directory is not

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(s.in_flight for s in self._serving.values())

    @property
    def calls_completed(self) -> int:
        with self._lock:
            return sum(s.calls_completed for s in self._serving.values())

    @property
    def pid(self) -> int:
        return os.getpid()


def _check_ids(ids: np.ndarray, num_experts: int) -> None:
    if ids.size and (ids.min() < -1 or ids.max() >= num_experts):
        raise BadCall(
            wire.STATUS_BAD_REQUEST,
            f"expert ids must be in [-1, {num_experts}), got [{ids.min()}, {ids.max()}]",
        )


def _check_arrays(req: ktshm.Message, hidden: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(req.arrays) != 3:
        raise BadCall(
            wire.STATUS_BAD_REQUEST,
            f"a MoE call carries 3 arrays (x, ids, weights), got {len(req.arrays)}",
        )
    x, ids, weights = req.arrays
    x_dtype, ids_dtype, w_dtype = req.dtypes
    if x_dtype not in wire.X_DTYPES or x.ndim != 2 or x.shape[1] != hidden:
        raise BadCall(
            wire.STATUS_BAD_REQUEST,
            f"x must be [T, {hidden}] float32 or bfloat16, got {list(x.shape)} {x_dtype}",
        )
    num_tokens = x.shape[0]
    if ids_dtype != wire.IDS_DTYPE or ids.ndim != 2 or ids.shape[0] != num_tokens:
        raise BadCall(
            wire.STATUS_BAD_REQUEST,
            f"ids must be [{num_tokens}, k] int32, got {list(ids.shape)} {ids_dtype}",
        )
    if w_dtype != wire.WEIGHTS_DTYPE or weights.shape != ids.shape:
        raise BadCall(
            wire.STATUS_BAD_REQUEST,
            f"weights must be {list(ids.shape)} float32, got {list(weights.shape)} {w_dtype}",
        )
    if req.num_tokens not in (0, num_tokens):
        raise BadCall(
            wire.STATUS_BAD_REQUEST, f"num_tokens {req.num_tokens} but x has {num_tokens} rows"
        )
    return x, ids, weights
