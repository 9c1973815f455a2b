"""Decode steps replayed as CUDA graphs: the GPU segments between the MoE layers' expert calls.

A decode step (every sequence adds one token) splits at each MoE layer m_j's call to the experts,
each part one of the methods CausalLM.forward runs too (the layers are split there, not here):

    segment 0    embed_tokens; layers before m_0; m_0.attend_then_norm, .mlp.route
                 -> x, ids, weights
    host         pending = experts.submit(x, ids, weights)   (copies into the expert channels)
    shared 0     m_0.mlp.shared_out(x)                       (a graph of its own: the GPU runs it
                                                              while the CPU computes the experts)
    host         routed <- pending.wait()                   (into a static buffer)
    segment 1    m_0.mlp.combine(routed, shared), added to h in the next layer's first norm;
                 the layers up to m_1's route ...
    segment n    combine(...); the layers left; logits -> [B_pad, V] float32

With expert deferral (MoE.num_deferred, layers/moe.py) segment j also splits m_j's routing into
an immediate and a deferred call; the host submits both, waits for the immediate one after
shared j and for m_{j-1}'s deferred one (into a second static buffer), which segment j + 1's
combine adds, as CausalLM.forward does. With device calls a deferring layer has two slots
(immediate, deferred, in that order: workers take the lowest posted slot first), and the step
collects m_{j-1}'s deferred reply right after m_j's immediate one.

With expert calls in the graph (DecodeGraphConfig.experts_in_graph, where the experts offer
device calls: gpu_service/experts/device_calls.py), the device stream itself copies each MoE layer's
inputs to the workers, rings them and waits for their replies, so the whole step is one graph
and no host code runs per layer:

    step graph   segment 0; per MoE layer j: calls.call(j, x, ids, weights); shared j;
                 calls.collect(j, routed); segment j + 1 ...; calls.end_step()
    host         calls.begin_step(B_pad, B); replay; calls.wait()

The graphs of a bucket (B_pad sequences, K_pad cached positions at most) are captured on its first
use, into one memory pool shared by every bucket. They read static inputs that each step fills
with one host-to-device copy: tokens, positions, slot_mapping and kv_len [B_pad], and the block
table [B_pad, K_pad / block_size] (int32; attention reads the cache through it: paged_decode).
Padding sequences write their K/V to the cache's scratch slot and attend to position 0 alone
(block 0, kv_len 1: a read of a real slot, never a write); their rows are dropped. With capture
off (no CUDA) the same segments run eagerly on the same inputs. The engine's Runner builds one
from a DecodeGraphConfig and sends it the decode steps that fit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_service.attention.batch import AttentionGroup, AttentionMetadata, Batch, StepContext
from gpu_service.experts.routed import abandon
from gpu_service.layers.moe import MoE
from gpu_service.models.model import CausalLM

log = logging.getLogger("ktserve.gpu")


@dataclass(frozen=True)
class DecodeGraphConfig:
    """max_batch: the largest decode batch run here (larger ones run eagerly). min_kv_bucket:
    the smallest K_pad, doubled as sequences grow. capture: record CUDA graphs (False runs the
    same segments eagerly: for devices without graphs, and for tests). experts_in_graph: the
    device makes the expert calls, one graph per step (where the experts can; else the host
    calls them between segments). chain_steps: a decode step that continues the last one is
    launched as soon as the last one's graph ends, its tokens taken on the device from the last
    step's samples, and the host reads the last step's tokens while it runs (engine.py)."""

    max_batch: int = 32
    min_kv_bucket: int = 256
    capture: bool = True
    experts_in_graph: bool = True
    chain_steps: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.min_kv_bucket < 1:
            raise ValueError(
                f"max_batch ({self.max_batch}) and min_kv_bucket ({self.min_kv_bucket}) "
                "must be >= 1"
            )

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """1, 2, 4, 8, then steps of 8, and max_batch itself."""
        sizes = [b for b in (1, 2, 4, 8) if b < self.max_batch]
        sizes += range(16, self.max_batch, 8)
        return (*sizes, self.max_batch)

    def kv_bucket(self, kv_len: int, block_size: int) -> int:
        bucket = self.min_kv_bucket
        while bucket < kv_len:
            bucket *= 2
        return -(-bucket // block_size) * block_size


@dataclass
class _SegmentOut:
    h: torch.Tensor  # [B_pad, H] the residual after m_j's attention
    ctx: StepContext
    moe_in: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x [B_pad, H], ids/weights [B_pad, k]
    later: tuple[torch.Tensor, torch.Tensor] | None = None  # m_j's deferred ids/weights


class Bucket:
    """Static inputs, the experts' reply buffer, and (once captured) the graphs and their
    outputs, of one (B_pad, K_pad)."""

    def __init__(self, batch: int, kv_pad: int, block_size: int, hidden: int,
                 device: torch.device) -> None:  # fmt: skip
        self.batch, self.kv_pad, self.block_size = batch, kv_pad, block_size
        num_blocks = kv_pad // block_size
        self.sizes = (batch, batch, batch, batch, batch * num_blocks)
        pinned = device.type == "cuda"
        self.host = torch.zeros(sum(self.sizes), dtype=torch.int32, pin_memory=pinned)
        self.inputs = torch.zeros(sum(self.sizes), dtype=torch.int32, device=device)
        tokens, positions, slots, kv_len, table = self.inputs.split(self.sizes)
        self.tokens, self.positions, self.slot_mapping = tokens, positions, slots
        self.kv_len = kv_len
        self.block_table = table.view(batch, num_blocks)
        self.rows = torch.arange(batch, device=device)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.routed = torch.zeros((batch, hidden), dtype=torch.float32, device=device)
        self.deferred = torch.zeros((batch, hidden), dtype=torch.float32, device=device)
        self.copied: torch.cuda.Event | None = None
        # per row, what its block table row holds since the last fill: (its sequence's block
        # list, how many of its blocks); None: a padding row
        self._table_rows: list[tuple | None] = [None] * batch
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list = []  # what each graph's stage returned when it was recorded

    def fill(self, batch: Batch | None, scratch_slot: int) -> None:
        """Host values of this step's sequences; every other row (all of them for None) is
        padding: token 0 at position 0, written to the scratch slot, reading block 0.
        A row's block table holds its sequence's blocks up to kv_len; what lies past them is
        never read (attention masks it; the entries are block ids all the same). A row that
        held the same sequence at the last fill gets only the blocks added since: a block list
        only grows while its sequence lives (a freed one gets a new list)."""
        if self.copied is not None:
            self.copied.synchronize()  # NOTE: the last step's copy may still read the host buffer
        host = self.host.numpy()
        tokens, positions, slots, kv_len, table = np.split(host, np.cumsum(self.sizes)[:-1])
        table = table.reshape(self.batch, -1)
        tokens[:], positions[:], slots[:], kv_len[:] = 0, 0, scratch_slot, 1
        seqs = batch.seqs if batch is not None else ()
        for i, s in enumerate(seqs):
            blocks, bs = s.cache.block_ids, s.cache.block_size
            tokens[i], positions[i], kv_len[i] = s.token_ids[0], s.start_pos, s.end_pos
            slots[i] = blocks[s.start_pos // bs] * bs + s.start_pos % bs
            n = -(-s.end_pos // bs)  # the blocks this row reads
            held = self._table_rows[i]
            start = min(held[1], n) if held is not None and held[0] is blocks else 0
            table[i, start:n] = blocks[start:n]
            self._table_rows[i] = (blocks, n)
        for i in range(len(seqs), self.batch):
            table[i, 0] = 0
            self._table_rows[i] = None

    def metadata(self) -> AttentionMetadata:
        """The step's metadata over the static inputs: one decode group of B_pad rows."""
        decode = AttentionGroup(slice(0, self.batch), self.block_table, self.cu_seqlens_q,
                                self.kv_len)  # fmt: skip
        return AttentionMetadata(
            positions=self.positions.long(), slot_mapping=self.slot_mapping.long(),
            last_index=self.rows, block_size=self.block_size, decodes=(decode,), prefill=None,
        )  # fmt: skip

    def upload(self) -> None:
        self.inputs.copy_(self.host, non_blocking=True)
        if self.inputs.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def replayer(self) -> Callable:
        """One step's stage runner: each call replays the next graph (recorded from the stage it
        is given, in the order _capture recorded them) and returns that graph's outputs."""
        recorded = iter(zip(self.graphs, self.outputs))

        def replay(stage: Callable, *args):
            graph, out = next(recorded)
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """Runs decode batches of `model` segment by segment (see the module docstring)."""

    def __init__(self, model: CausalLM, config: DecodeGraphConfig) -> None:
        if config.capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.config = model, config
        layers = model.layers
        self.moe_layers = tuple(i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoE))
        self.moes: tuple[MoE, ...] = tuple(layers[i].mlp for i in self.moe_layers)
        self._buckets: dict[tuple[int, int], Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if config.capture else None
        self.num_graphs = 0
        self.calls = self._device_calls() if config.experts_in_graph and self.moes else None
        self._launched = False  # a step with device calls launched and not yet waited for
        self.last_replay_seconds = 0.0  # launch(): the host's replay() call of its graph (0: none)

    def _device_calls(self):
        experts = {id(moe.experts): moe.experts for moe in self.moes}
        backend = next(iter(experts.values()))
        if len(experts) != 1 or not hasattr(backend, "device_calls"):
            log.info("decode steps call the experts between graph segments: %s makes no device "
                     "calls", type(backend).__name__)  # fmt: skip
            return None
        slots: list[int] = []  # the MoE layer of each device slot
        self.slot_now, self.slot_later = [], []  # per MoE layer j: its slots (later: or None)
        for moe in self.moes:
            self.slot_now.append(len(slots))
            slots.append(moe.layer)
            self.slot_later.append(len(slots) if moe.num_deferred else None)
            if moe.num_deferred:
                slots.append(moe.layer)
        return backend.device_calls(tuple(slots), self.config.max_batch)

    def warm_up(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        """Capture the buckets of these batch sizes at the shortest context now, not mid-request."""
        for size in batch_sizes:
            self._bucket(size, 1)

    def supports(self, seqs: Sequence) -> bool:
        """Whether a step of these sequences (a Batch's, or a scheduled step's: anything with
        token_ids) runs here: a decode step of at most max_batch sequences."""
        return len(seqs) <= self.config.max_batch and all(len(s.token_ids) == 1 for s in seqs)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """float32 logits [B, V], as CausalLM.forward(batch) gives for a decode batch."""
        logits = self.launch(batch, self.prepare(batch))
        self.wait()
        return logits

    @torch.inference_mode()
    def prepare(self, batch: Batch, capture: bool = True) -> Bucket | None:
        """The batch's bucket with its inputs filled and their copy to the device queued (what
        may run while another step is on the device: the copy follows it on the stream); None
        where its graphs are not captured yet and capture is False (a capture runs a step of
        its own)."""
        if not self.supports(batch.seqs):
            raise ValueError(
                f"not a decode batch of at most {self.config.max_batch} sequences with one "
                "token each"
            )
        model = self.model
        model.check_batch(batch)
        bucket = self._bucket(len(batch.seqs), max(s.end_pos for s in batch.seqs), capture)
        if bucket is not None:
            bucket.fill(batch, model.kv_cache.scratch_slot)
            bucket.upload()
        return bucket

    @torch.inference_mode()
    def launch(self, batch: Batch, bucket: Bucket,
               tokens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Start the prepared step (after the last one's wait()): float32 logits [B, V], to be
        read on the stream, final once wait() returns. tokens: [B] the rows' input ids on the
        device, in place of the batch's (a chained step's: the last step's samples)."""
        if self._launched:
            raise RuntimeError("a decode step is still on the device: wait() for it first")
        b = len(batch.seqs)
        self.last_replay_seconds = 0.0
        if tokens is not None:
            bucket.tokens[:b].copy_(tokens)
        logits = self._run(bucket, b)
        for s in batch.seqs:
            s.cache.num_tokens = s.end_pos
        return logits[:b]

    def wake(self) -> None:
        """Host, after a launch it does other work behind: until the step's first expert calls
        reach the workers (DeviceCalls.wake)."""
        if self._launched:
            self.calls.wake()

    def wait(self) -> None:
        """Host: see the launched step through (DeviceCalls.wait: raises ExpertsUnavailable where
        the workers failed it). A step whose expert calls the host makes is through at launch."""
        if not self._launched:
            return
        self._launched = False
        self.calls.wait()

    # ------------------------------------------------------------------ execution
    def _run(self, bucket: Bucket, b: int) -> torch.Tensor:
        """The stages in the order _capture records them: with capture on each replays its graph,
        with capture off it computes. With device calls the step is only launched (wait())."""
        if self.calls is not None:
            self.calls.begin_step(bucket.batch, b)
            if self.config.capture:
                replay_at = time.perf_counter()
                bucket.graphs[0].replay()
                self.last_replay_seconds = time.perf_counter() - replay_at
                logits = bucket.outputs[0]
            else:
                logits = self._step(bucket)
            self._launched = True
            return logits
        run = bucket.replayer() if self.config.capture else _compute
        out = run(self._segment, bucket, 0, None, None)
        pending = deferred = later = None  # m_j's immediate call, m_{j-1}'s deferred one, m_j's
        try:
            for j, moe in enumerate(self.moes):
                x, ids, weights = out.moe_in
                # NOTE: submit before the shared expert and wait after it: the GPU computes it
                # while the CPU computes the routed experts (and m_j's deferred ones after them)
                pending = moe.experts.submit(moe.layer, x[:b], ids[:b], weights[:b])
                if out.later is not None:
                    later_ids, later_weights = out.later
                    later = moe.experts.submit(moe.layer, x[:b], later_ids[:b], later_weights[:b])
                shared = run(moe.shared_out, x) if moe.shared is not None else None
                bucket.routed[:b].copy_(pending.wait())
                if deferred is not None:
                    bucket.deferred[:b].copy_(deferred.wait())
                deferred, later = later, None
                out = run(self._segment, bucket, j + 1, out, shared)
        except BaseException:
            for call in (pending, deferred, later):
                abandon(call)
            raise
        return out

    def _step(self, bucket: Bucket) -> torch.Tensor:
        """The whole step with the device's expert calls: logits [B_pad, V] float32."""
        calls = self.calls
        out = self._segment(bucket, 0, None, None)
        for j, moe in enumerate(self.moes):
            x, ids, weights = out.moe_in
            calls.call(self.slot_now[j], x, ids, weights)
            if out.later is not None:
                calls.call(self.slot_later[j], x, *out.later)
            shared = moe.shared_out(x) if moe.shared is not None else None
            calls.collect(self.slot_now[j], bucket.routed)
            if j >= 1 and self.slot_later[j - 1] is not None:
                calls.collect(self.slot_later[j - 1], bucket.deferred)
            out = self._segment(bucket, j + 1, out, shared)
        calls.end_step()
        return out

    def _segment(self, bucket: Bucket, j: int, prev: _SegmentOut | None,
                 shared: torch.Tensor | None):  # fmt: skip
        """Segment j (its MoE reply in bucket.routed): a _SegmentOut, or for the last one the
        logits [B_pad, V] float32."""
        model, layers = self.model, self.model.layers
        pending = None  # an MLP output not yet added to h (the next layer's first norm adds it)
        if prev is None:
            h = model.embed_tokens(bucket.tokens)  # [B_pad, H]
            ctx = model.context(bucket.metadata())
            first = 0
        else:
            x = prev.moe_in[0]
            joined = bucket.deferred if j >= 2 and self.moes[j - 2].num_deferred else None
            pending = self.moes[j - 1].combine(bucket.routed, shared, x.dtype, joined)
            h, ctx, first = prev.h, prev.ctx, self.moe_layers[j - 1] + 1
        last = self.moe_layers[j] if j < len(self.moe_layers) else len(layers)
        for layer in layers[first:last]:
            h, x = layer.attend_then_norm(h, ctx, pending)
            pending = layer.mlp(x)
        if j == len(self.moe_layers):
            return model.logits(h if pending is None else h + pending)
        layer = layers[last]
        h, x = layer.attend_then_norm(h, ctx, pending)
        now, later = layer.mlp.split(*layer.mlp.route(x))
        return _SegmentOut(h, ctx, (x, *now), later)

    # ------------------------------------------------------------------ capture
    def _bucket(self, batch: int, kv_len: int, capture: bool = True) -> Bucket | None:
        cfg, cache = self.config, self.model.kv_cache
        b_pad = next(size for size in cfg.batch_buckets if size >= batch)
        k_pad = cfg.kv_bucket(kv_len, cache.block_size)
        bucket = self._buckets.get((b_pad, k_pad))
        if bucket is None and not capture:
            return None
        if bucket is None:
            hidden = self.model.config.hidden_size
            bucket = Bucket(b_pad, k_pad, cache.block_size, hidden, self.model.device)
            if self.calls is not None:
                self.calls.layout(b_pad)
            if cfg.capture and self.calls is not None:
                self._capture_step(bucket)
            elif cfg.capture:
                self._capture(bucket)
            self._buckets[(b_pad, k_pad)] = bucket
        return bucket

    def _capture(self, bucket: Bucket) -> None:
        """Graphs in replay order: segment 0, then per MoE layer [shared], next segment.
        Inputs are all padding meanwhile, so warm-up and capture write only the scratch slot."""
        start = time.perf_counter()
        bucket.fill(None, self.model.kv_cache.scratch_slot)
        bucket.upload()
        out = self._record(bucket, self._segment, bucket, 0, None, None)
        for j, moe in enumerate(self.moes):
            shared = None
            if moe.shared is not None:
                shared = self._record(bucket, moe.shared_out, out.moe_in[0])
            out = self._record(bucket, self._segment, bucket, j + 1, out, shared)
        torch.cuda.synchronize(self.model.device)
        self.num_graphs += len(bucket.graphs)
        log.info(
            "captured %d CUDA graphs for decode batches of %d (context up to %d) in %.2f s",
            len(bucket.graphs), bucket.batch, bucket.kv_pad, time.perf_counter() - start,
        )  # fmt: skip

    def _capture_step(self, bucket: Bucket) -> None:
        """The whole step as one graph: warm up (a real step, the workers answer it), capture,
        replay once; each run's expert calls seen through by the host."""
        start = time.perf_counter()
        calls = self.calls
        bucket.fill(None, self.model.kv_cache.scratch_slot)
        bucket.upload()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        calls.begin_step(bucket.batch, bucket.batch)
        with torch.cuda.stream(stream):
            self._step(bucket)
        calls.wait()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(bucket)
        calls.begin_step(bucket.batch, bucket.batch)
        graph.replay()
        calls.wait()
        torch.cuda.synchronize(self.model.device)
        bucket.graphs.append(graph)
        bucket.outputs.append(out)
        self.num_graphs += 1
        log.info(
            "captured the decode step of batch %d (context up to %d) as one CUDA graph, its "
            "expert calls inside, in %.2f s", bucket.batch, bucket.kv_pad,
            time.perf_counter() - start,
        )  # fmt: skip

    def close(self) -> None:
        self._buckets.clear()  # NOTE: the graphs first: they captured the KV cache's addresses
        if self.calls is not None:
            self.calls.close()

    def _record(self, bucket: Bucket, stage: Callable, *args):
        """Warm up on a side stream, capture, replay once (so the outputs hold real values)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            stage(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = stage(*args)
        graph.replay()
        bucket.graphs.append(graph)
        bucket.outputs.append(out)
        return out


def _compute(stage: Callable, *args):
    return stage(*args)
