"""Segmented decode (CUDA graphs on CUDA, the same segments eagerly elsewhere) against the eager
forward pass of the same checkpoint, which test_models checks against transformers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gpu_service.engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import Batch, CausalLM, SeqInput, TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.checkpoints import available_families

VARIANTS = {  # family, overrides: each family, a shared gate (Qwen2) and a sliding window
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral_window": ("mixtral", {"sliding_window": 12}),
}
NAMES = [v for v in VARIANTS if VARIANTS[v][0] in available_families()]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCK = 4


CHECKPOINTS = {
    name: TinyCheckpoint(VARIANTS[name][0], seed_offset=i, overrides=VARIANTS[name][1])
    for i, name in enumerate(NAMES)
}


def _load(path, device: str) -> CausalLM:
    experts = TorchExperts(CheckpointReader(path), device, torch.float32)
    return load_model(path, device, torch.float32, experts=experts, max_num_tokens_in_cache=512,
                      block_size=BLOCK)  # fmt: skip


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Pair:
    """The same sequences in two models: `eager` runs CausalLM.forward, `seg` DecodeGraphs."""

    def __init__(self, path, device: str, config: DecodeGraphConfig) -> None:
        self.eager, self.seg = _load(path, device), _load(path, device)
        self.graphs = DecodeGraphs(self.seg, config)
        self.kvs = tuple(KVCacheManager(m.kv_cache.config) for m in (self.eager, self.seg))
        self.caches: dict[int, tuple] = {}
        self.next_token: dict[int, int] = {}
        self.pos: dict[int, int] = {}

    def add(self, key: int, prompt: list[int]) -> None:
        caches = tuple(kv.allocate(len(prompt)) for kv in self.kvs)
        models = (self.eager, self.seg)
        logits = [m.forward(Batch((SeqInput(prompt, c, 0),))) for m, c in zip(models, caches)]
        self.caches[key], self.pos[key] = caches, len(prompt)
        self.next_token[key] = int(logits[0][0].argmax())

    def drop(self, key: int) -> None:
        for kv, cache in zip(self.kvs, self.caches.pop(key)):
            kv.free(cache)

    def step(self) -> float:
        """One decode step of every live sequence in both; the largest relative logits error."""
        keys = sorted(self.caches)
        batches = []
        for side, kv in enumerate(self.kvs):
            seqs = []
            for key in keys:
                cache = self.caches[key][side]
                kv.extend(cache, self.pos[key] + 1)
                seqs.append(SeqInput([self.next_token[key]], cache, self.pos[key]))
            batches.append(Batch(tuple(seqs)))
        reference = self.eager.forward(batches[0])
        assert self.graphs.supports(batches[1].seqs)
        got = self.graphs.forward(batches[1])
        assert got.shape == reference.shape and got.dtype == torch.float32
        for i, key in enumerate(keys):
            self.pos[key] += 1
            self.next_token[key] = int(reference[i].argmax())
            assert self.caches[key][1].num_tokens == self.pos[key]
        return _rel_err(got, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_segmented_decode_matches_eager(checkpoints, seed, name: str, device: str) -> None:
    """Batches of 1-5 sequences (padded to 1, 2, 4, 8), joining and leaving, contexts crossing
    K buckets (8, 16, 32, 64): logits match the eager forward, and after all of it both KV caches
    hold the same values everywhere but the scratch slot (padding rows wrote nowhere else)."""
    config = DecodeGraphConfig(max_batch=8, min_kv_bucket=8, capture=device == "cuda")
    pair = Pair(checkpoints[name], device, config)
    gen = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 101, (n,), generator=gen).tolist()

    errors = []
    pair.add(0, prompt(5))
    errors += [pair.step() for _ in range(4)]  # batch 1
    pair.add(1, prompt(13))
    pair.add(2, prompt(2))
    errors += [pair.step() for _ in range(6)]  # batch 3 -> bucket 4
    pair.drop(1)
    pair.add(3, prompt(7))
    pair.add(4, prompt(30))
    pair.add(5, prompt(1))
    errors += [pair.step() for _ in range(8)]  # batch 5 -> bucket 8, contexts past 32
    print(f"[{name} {device}] max rel logits err {max(errors):.2e} over {len(errors)} steps")
    assert max(errors) < 1e-4
    scratch = pair.seg.kv_cache.scratch_slot
    for eager_layer, seg_layer in zip(pair.eager.kv_cache.layers, pair.seg.kv_cache.layers):
        for a, b in zip(eager_layer, seg_layer):
            assert _rel_err(b[:scratch], a[:scratch]) < 1e-4
    if config.capture:
        assert pair.graphs.num_graphs > 0


class _StandInGraph:
    """A CUDA graph's stand-in on the CPU: replay recomputes the recorded stage from the same
    arguments (static buffers, as a graph reads them) into the outputs recorded with it."""

    def __init__(self, events: list[str], stage, args: tuple, out) -> None:
        self.events, self.stage, self.args, self.out = events, stage, args, out

    def replay(self) -> None:
        self.events.append(self.stage.__name__)
        for dst, src in zip(_tensors(self.out), _tensors(self.stage(*self.args)), strict=True):
            dst.copy_(src)


def _tensors(out) -> list[torch.Tensor]:
    """What a stage hands on: logits, or the residual, the MoE input and the step context."""
    if isinstance(out, torch.Tensor):
        return [out]
    meta = [getattr(out.ctx.meta, f.name) for f in dataclasses.fields(out.ctx.meta)]
    meta = [value for value in meta if isinstance(value, torch.Tensor)]
    return [out.h, *out.moe_in, out.ctx.cos, out.ctx.sin, *meta]


def _greedy_decode(graphs: DecodeGraphs, prompts: list[list[int]], joiner: list[int],
                   steps: int = 12, join_at: int = 4, leave_at: int = 8) -> list:  # fmt: skip
    """Each decode step's logits; `joiner` is prefilled at join_at and freed at leave_at."""
    model, out = graphs.model, []
    kv = KVCacheManager(model.kv_cache.config)
    caches = [kv.allocate(len(p)) for p in prompts]
    logits = model.forward(Batch(tuple(SeqInput(p, c, 0) for p, c in zip(prompts, caches))))
    pos, tokens = [len(p) for p in prompts], logits.argmax(-1).tolist()
    for step in range(steps):
        if step == join_at:
            caches.append(kv.allocate(len(joiner)))
            logits = model.forward(Batch((SeqInput(joiner, caches[-1], 0),)))
            pos.append(len(joiner))
            tokens.append(int(logits[0].argmax()))
        if step == leave_at:
            kv.free(caches.pop())
            pos.pop()
            tokens.pop()
        for cache, p in zip(caches, pos):
            kv.extend(cache, p + 1)
        batch = Batch(tuple(SeqInput([t], c, p) for t, c, p in zip(tokens, caches, pos)))
        out.append(graphs.forward(batch).clone())
        pos, tokens = [p + 1 for p in pos], out[-1].argmax(-1).tolist()
    return out


@pytest.mark.parametrize("name", NAMES)
def test_replay_follows_the_capture_order(checkpoints, monkeypatch, seed, name: str) -> None:
    """The capture path's bookkeeping without CUDA: _record hands out stand-in graphs, and the
    rest (_capture, the static buffers, _run replaying) runs as written. Over two K buckets and
    a batch that grows and shrinks in its bucket (stale padding rows), the logits equal those of
    capture off bit for bit, and per MoE layer a step submits, replays the shared expert's graph
    while the experts compute, then waits."""
    events: list[str] = []

    def record(self, bucket, stage, *args):
        out = stage(*args)
        bucket.graphs.append(_StandInGraph(events, stage, args, out))
        bucket.outputs.append(out)
        return out

    class Logged:
        def __init__(self, pending) -> None:
            self.pending = pending

        def wait(self) -> torch.Tensor:
            events.append("wait")
            return self.pending.wait()

    submit = TorchExperts.submit

    def logged_submit(self, layer, x, ids, weights):
        events.append("submit")
        return Logged(submit(self, layer, x, ids, weights))

    monkeypatch.setattr(DecodeGraphs, "_record", record)
    monkeypatch.setattr(TorchExperts, "submit", logged_submit)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 13, 2, 9)]
    config = DecodeGraphConfig(max_batch=4, min_kv_bucket=8, capture=False)
    eager = DecodeGraphs(_load(checkpoints[name], "cpu"), config)
    replayed = DecodeGraphs(_load(checkpoints[name], "cpu"), config)
    replayed.config = dataclasses.replace(config, capture=True)  # NOTE: __init__ refuses the CPU
    want = _greedy_decode(eager, prompts[:3], prompts[3])
    events.clear()
    got = _greedy_decode(replayed, prompts[:3], prompts[3])
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}"
    last_step = ["_segment"]
    for moe in replayed.moes:
        last_step += ["submit", *(["shared_out"] if moe.shared is not None else []), "wait"]
        last_step += ["_segment"]
    assert events[-len(last_step) :] == last_step
    per_bucket = last_step.count("_segment") + last_step.count("shared_out")
    assert replayed.num_graphs == 2 * per_bucket  # buckets (4, 16) and (4, 32)


def test_graphs_refuse_what_they_cannot_run(checkpoints) -> None:
    model = _load(checkpoints[NAMES[0]], "cpu")
    graphs = DecodeGraphs(model, DecodeGraphConfig(max_batch=2, capture=False))
    kv = KVCacheManager(model.kv_cache.config)
    caches = [kv.allocate(4) for _ in range(3)]
    prefill = Batch((SeqInput([1, 2], caches[0], 0),))
    too_many = Batch(tuple(SeqInput([1], c, 0) for c in caches))
    for batch in (prefill, too_many):
        assert not graphs.supports(batch.seqs)
        with pytest.raises(ValueError, match="not a decode batch"):
            graphs.forward(batch)
    beyond = Batch((SeqInput([1], caches[0], 0),))
    caches[0].num_tokens = 0
    with pytest.raises(ValueError, match="token ids"):
        graphs.forward(Batch((SeqInput([10**6], caches[1], 0),)))
    assert graphs.forward(beyond).shape == (1, model.config.vocab_size)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(model, DecodeGraphConfig(capture=True))


def test_buckets() -> None:
    config = DecodeGraphConfig(max_batch=32, min_kv_bucket=256)
    assert config.batch_buckets == (1, 2, 4, 8, 16, 24, 32)
    assert DecodeGraphConfig(max_batch=3).batch_buckets == (1, 2, 3)
    assert [config.kv_bucket(n, 16) for n in (1, 256, 257, 5000)] == [256, 256, 512, 8192]
    assert DecodeGraphConfig(min_kv_bucket=10).kv_bucket(11, 16) == 32
    with pytest.raises(ValueError, match="must be >= 1"):
        DecodeGraphConfig(max_batch=0)


def test_a_bucket_row_keeps_what_its_sequence_wrote_and_a_new_sequence_rewrites_it(seed):
    """fill over steps whose rows grow, swap, leave and come back: each real row's block table
    holds its sequence's blocks up to kv_len and each padding row reads block 0; a row that holds
    the same sequence as at the last fill gets only its new blocks (the one written before is
    left as it was), a row whose sequence changed (another one, or the same one freed and
    allocated again: a new block list) is written anew."""
    from gpu_service.engine.decode_graphs import Bucket
    from gpu_service.kvcache.sequence import SeqCache

    g = torch.Generator().manual_seed(seed)
    bucket = Bucket(4, 64, BLOCK, 8, torch.device("cpu"))

    def cache(seq_id: int, num_tokens: int) -> SeqCache:
        blocks = torch.randperm(200, generator=g)[: -(-(num_tokens + 1) // BLOCK)].tolist()
        return SeqCache(seq_id, BLOCK, blocks, num_tokens)

    def step(*caches: SeqCache, check: bool = True) -> None:
        """Each cache one token further: its block list grows where that needs a block."""
        seqs = []
        for c in caches:
            if c.num_tokens + 1 > len(c.block_ids) * BLOCK:
                c.block_ids.append(int(torch.randint(200, 400, (1,), generator=g)))
            seqs.append(SeqInput([7], c, c.num_tokens))
        bucket.fill(Batch(tuple(seqs)), scratch_slot=999)
        host = bucket.host.numpy()
        tokens, positions, slots, kv_len, table = np.split(host, np.cumsum(bucket.sizes)[:-1])
        table = table.reshape(bucket.batch, -1)
        for i, c in enumerate(caches):
            n = -(-(c.num_tokens + 1) // BLOCK)
            assert table[i, :n].tolist() == c.block_ids[:n] or not check, f"row {i}"
            assert kv_len[i] == c.num_tokens + 1 and positions[i] == c.num_tokens
            assert slots[i] == c.block_ids[c.num_tokens // BLOCK] * BLOCK + c.num_tokens % BLOCK
            c.num_tokens += 1
        for i in range(len(caches), bucket.batch):
            assert (table[i, 0], kv_len[i], slots[i], tokens[i]) == (0, 1, 999, 0), f"pad {i}"

    a, b = cache(0, 14), cache(1, 30)  # a crosses into its second block at the next step
    step(a, b)
    step(a, b)
    # NOTE: a stand-in where a's first block sits: a row of the same sequence is not rewritten
    first = bucket.host.numpy()[sum(bucket.sizes[:4])]
    bucket.host.numpy()[sum(bucket.sizes[:4])] = -7
    step(a, b, check=False)
    assert bucket.host.numpy()[sum(bucket.sizes[:4])] == -7
    bucket.host.numpy()[sum(bucket.sizes[:4])] = first
    step(b, a)  # swapped: both rows written anew
    step(b, a, cache(2, 40))
    a.block_ids = list(a.block_ids)  # freed and allocated again: the same ids, a new list
    a.block_ids[0] = 399
    step(b, a)
    step(b)
    step(cache(3, 3), b)
