"""Expert deferral (KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN, layers/moe.py) against a reference
written here in plain torch: per MoE layer, each token's D lowest-weight routed experts (ids and
weights from the router, which test_models checks against transformers; expert weights read from
transformers' own modules) are computed apart and their output added at the next MoE layer's
output instead of their own; the last MoE layer defers nothing. Deferral is per token, so one
reference pass over a sequence gives the logits of its prefill (whole or chunked) and of each of
its decode steps."""

from __future__ import annotations

import argparse
import contextlib
import socket

import pytest
import torch
import torch.nn.functional as F

from gpu_service.attention.batch import AttentionMetadata
from gpu_service.config import ExpertClientConfig, GPUServiceConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig, DecodeGraphs
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.layers.moe import MoE
from gpu_service.models import Batch, CausalLM, SeqInput, TorchExperts, load_model
from gpu_service.serve_config import ServeConfig
from ktserve import envs
from ktserve.checkpoint import CheckpointReader
from ktserve.config_flags import add_flags, from_args
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.checkpoints import (
    available_families,
    load_reference_model,
    reference_expert_weights,
)
from tests.support.expert_procs import ExpertProcess

FAMILIES = [f for f in ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral")
            if f in available_families()]  # fmt: skip
BLOCK = 4


CHECKPOINTS = one_per_family(FAMILIES, distinct_seeds=True)


def _load(path, deferred: int, experts=None) -> CausalLM:
    experts = experts or TorchExperts(CheckpointReader(path), "cpu", torch.float32)
    return load_model(path, "cpu", torch.float32, experts=experts, max_num_tokens_in_cache=512,
                      block_size=BLOCK, max_deferred_experts_per_token=deferred)  # fmt: skip


def _top_k(model: CausalLM) -> int:
    return model.moes[0].router.top_k


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


class Reference:
    """Logits [n, V] of every position of a sequence with D deferred experts per token."""

    def __init__(self, path, model: CausalLM) -> None:
        self.model = model  # its attention, norms, router and shared experts (test_models)
        hf = load_reference_model(path)
        self.moe_layers = [i for i, layer in enumerate(model.layers)
                           if isinstance(layer.mlp, MoE)]  # fmt: skip
        num_experts = CheckpointReader(path).spec.num_experts
        self.experts = {
            i: [reference_expert_weights(hf, i, e) for e in range(num_experts)]
            for i in self.moe_layers
        }

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.experts[layer][e]
        return F.linear(F.silu(F.linear(x, gate.float())) * F.linear(x, up.float()), down.float())

    @torch.inference_mode()
    def logits(self, tokens: list[int], deferred: int) -> torch.Tensor:
        model = self.model
        kv = KVCacheManager(model.kv_cache.config)
        cache = kv.allocate(len(tokens))
        try:
            batch = Batch((SeqInput(tokens, cache, 0),))
            ctx = model.context(AttentionMetadata.build(batch, model.device))
            h = model.embed_tokens(torch.tensor(tokens))  # [T, H]
            pending = None  # the previous MoE layer's deferred output [T, H]
            for i, layer in enumerate(model.layers):
                h, x = layer.attend_then_norm(h, ctx)
                if i not in self.moe_layers:
                    h = h + layer.mlp(x)
                    continue
                moe = layer.mlp
                ids, weights = moe.route(x)
                k = ids.shape[1]
                num = deferred if i != self.moe_layers[-1] else 0
                now, later = torch.zeros_like(x), torch.zeros_like(x)
                for t in range(len(tokens)):
                    # highest weight first; ties: the earlier column first (sorted is stable)
                    order = sorted(range(k), key=lambda j: -float(weights[t, j]))
                    for rank, j in enumerate(order):
                        y = self.expert(i, int(ids[t, j]), x[t]) * weights[t, j]
                        if rank >= k - num:
                            later[t] += y
                        else:
                            now[t] += y
                out = now
                shared = moe.shared_out(x)
                if shared is not None:
                    out = out + shared
                if pending is not None:
                    out = out + pending
                pending = later if num else None
                h = h + out
            return model.logits(h)
        finally:
            kv.free(cache)


def test_no_deferral_is_the_forward_of_today(checkpoints, seed) -> None:
    """D = 0: the MoE layers' split hands the router's own tensors on, and the logits are
    bit-identical to the per-layer forward (DecoderLayer.forward, MoE.forward) of before."""
    for family, path in checkpoints.items():
        model = _load(path, 0)
        assert model.num_deferred_experts == 0
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 101, (11,), generator=gen).tolist()
        cache = KVCacheManager(model.kv_cache.config).allocate(len(tokens))
        got = model.forward(Batch((SeqInput(tokens, cache, 0),)), all_positions=True)
        with torch.inference_mode():
            batch = Batch((SeqInput(tokens, cache, 0),))
            ctx = model.context(AttentionMetadata.build(batch, model.device))
            h = model.embed_tokens(torch.tensor(tokens))
            for layer in model.layers:
                _, x = layer.attend_then_norm(h, ctx)
                if isinstance(layer.mlp, MoE):
                    ids, weights = layer.mlp.route(x)
                    (ids2, weights2), later = layer.mlp.split(ids, weights)
                    assert ids2 is ids and weights2 is weights and later is None
                h = layer(h, ctx)
            want = model.logits(h)
        assert torch.equal(got, want), family


@pytest.mark.parametrize(
    "family",
    [f for f in FAMILIES if f in ("deepseek_v3", "qwen3_moe")]
    + [f for f in FAMILIES if f not in ("deepseek_v3", "qwen3_moe")],
)
def test_deferral_matches_the_reference(checkpoints, seed, family: str) -> None:
    """For each D in 1..top_k-1: chunked prefill and eager decode (CausalLM.forward) and
    segmented decode (DecodeGraphs, capture off) of three sequences give the reference's logits
    at every position; deferral changes them (against D = 0)."""
    path = checkpoints[family]
    reference = Reference(path, _load(path, 0))
    for deferred in range(1, _top_k(reference.model)):
        eager, seg = _load(path, deferred), _load(path, deferred)
        assert [m.num_deferred for m in eager.moes] == [deferred] * (len(eager.moes) - 1) + [0]
        graphs = DecodeGraphs(seg, DecodeGraphConfig(max_batch=4, min_kv_bucket=8,
                                                     capture=False))  # fmt: skip
        assert graphs.calls is None
        gen = torch.Generator().manual_seed(seed + deferred)
        prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (9, 4, 6)]
        seqs, caches, worst = [list(p) for p in prompts], [], 0.0
        kvs = (KVCacheManager(eager.kv_cache.config), KVCacheManager(seg.kv_cache.config))
        for i, prompt in enumerate(prompts):
            pair = (kvs[0].allocate(len(prompt)), kvs[1].allocate(len(prompt)))
            caches.append(pair)
            cut = len(prompt) // 2 if i == 0 else len(prompt)  # the first: in two chunks
            chunks = [eager.forward(Batch((SeqInput(prompt[:cut], pair[0], 0),)),
                                    all_positions=True)]  # fmt: skip
            if cut < len(prompt):
                chunks.append(eager.forward(Batch((SeqInput(prompt[cut:], pair[0], cut),)),
                                            all_positions=True))  # fmt: skip
            prefill = torch.cat(chunks)
            seg.forward(Batch((SeqInput(prompt, pair[1], 0),)))
            want = reference.logits(prompt, deferred)
            worst = max(worst, _rel_err(prefill, want))
            seqs[i].append(int(prefill[-1].argmax()))
        steps = []
        for _ in range(4):
            batches = []
            for side, kv in enumerate(kvs):
                inputs = []
                for seq, pair in zip(seqs, caches):
                    kv.extend(pair[side], len(seq))
                    inputs.append(SeqInput([seq[-1]], pair[side], len(seq) - 1))
                batches.append(Batch(tuple(inputs)))
            got_eager, got_seg = eager.forward(batches[0]), graphs.forward(batches[1])
            steps.append((got_eager, got_seg, [len(s) - 1 for s in seqs]))
            for seq, row in zip(seqs, got_eager):
                seq.append(int(row.argmax()))
        full = [reference.logits(seq[:-1], deferred) for seq in seqs]
        for got_eager, got_seg, positions in steps:
            want = torch.stack([f[p] for f, p in zip(full, positions)])
            worst = max(worst, _rel_err(got_eager, want), _rel_err(got_seg, want))
        off = reference.logits(seqs[0][:-1], 0)
        change = _rel_err(full[0], off)
        print(
            f"[{family} D={deferred}] seed {seed}: max rel logits err {worst:.2e}; "
            f"deferral moved the logits by {change:.2e}"
        )
        assert worst < 1e-4
        assert change > 1e-5  # deferral does something


def test_invalid_deferral_is_a_clear_error(checkpoints) -> None:
    path = checkpoints[FAMILIES[0]]
    top_k = CheckpointReader(path).spec.num_experts_per_tok
    for bad in (top_k, top_k + 1, -1):
        with pytest.raises(ValueError, match="max_deferred_experts_per_token must be >= 0 and "
                                              f"below the model's {top_k}"):  # fmt: skip
            _load(path, bad)
    with pytest.raises(ValueError, match="KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN must be >= 0"):
        GPUServiceConfig(model_dir=str(path), max_deferred_experts_per_token=-1)
    with pytest.raises(ValueError, match="needs 3 slots per expert channel"):
        GPUServiceConfig(model_dir=str(path), max_deferred_experts_per_token=1,
                         experts=ExpertClientConfig(num_slots=2))  # fmt: skip
    model = _load(path, 0)
    model.defer_experts(top_k - 1)
    with pytest.raises(RuntimeError, match="step"):
        model.moes[0](torch.zeros(1, model.config.hidden_size))


def test_the_variable_sets_the_field(checkpoints, monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    assert "--max-deferred-experts-per-token" not in parser.format_help()
    assert envs.ENV_VARS["KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN"].doc
    path = str(checkpoints[FAMILIES[0]])
    monkeypatch.setenv(envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name, "2")
    args = parser.parse_args([path])
    assert from_args(ServeConfig, args).gpu.max_deferred_experts_per_token == 2
    monkeypatch.delenv(envs.MAX_DEFERRED_EXPERTS_PER_TOKEN.name)
    args = parser.parse_args([path])
    assert from_args(ServeConfig, args).gpu.max_deferred_experts_per_token == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def worker_experts(path, device: str):
    """(the checkpoint's spec, ShmExperts on `device`) on a real `ktserve expert` worker holding
    all its experts in bf16, float32 on the wire; both stopped when the block ends."""
    spec = CheckpointReader(path).spec
    worker = ExpertProcess("--model", str(path), "--format", "bf16", "--listen",
                           f"127.0.0.1:{_free_port()}")  # fmt: skip
    try:
        experts = ShmExperts(
            ExpertClientConfig((worker.address,), token=worker.token, wire_dtype="float32",
                               worker_timeout_s=20),
            hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=64,
            device=device,
        )  # fmt: skip
        try:
            yield spec, experts
        finally:
            experts.close()
    finally:
        worker.close()


@pytest.mark.parametrize("family", [f for f in ("deepseek_v3", "qwen3_moe") if f in FAMILIES])
def test_a_real_worker_gives_the_tokens_of_torch_experts(checkpoints, seed, family) -> None:
    """Two calls per MoE layer in flight on the worker's channel (the deferred one waited for a
    layer later): greedy tokens of eager and segmented decode as with TorchExperts, logits
    within bf16 tolerance."""
    path = checkpoints[family]
    with worker_experts(path, "cpu") as (spec, experts):
        deferred = spec.num_experts_per_tok - 1
        shm, oracle = _load(path, deferred, experts), _load(path, deferred)
        graphs = DecodeGraphs(shm, DecodeGraphConfig(4, 8, False, experts_in_graph=False))
        reference = DecodeGraphs(oracle, DecodeGraphConfig(4, 8, capture=False))
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (7, 3)]
        sides = []
        for model in (shm, oracle):
            kv = KVCacheManager(model.kv_cache.config)
            caches = [kv.allocate(len(p)) for p in prompts]
            logits = model.forward(Batch(tuple(SeqInput(p, c, 0) for p, c in
                                               zip(prompts, caches))))  # fmt: skip
            sides.append((model, kv, caches, logits))
        worst, mismatches = _rel_err(sides[0][3], sides[1][3]), 0
        tokens = [sides[1][3].argmax(-1).tolist()]
        pos = [len(p) for p in prompts]
        for step in range(6):
            outs = []
            for (model, kv, caches, _), g in zip(sides, (graphs, reference)):
                for c, p in zip(caches, pos):
                    kv.extend(c, p + 1)
                batch = Batch(tuple(SeqInput([t], c, p) for t, c, p in
                                    zip(tokens[-1], caches, pos)))  # fmt: skip
                outs.append((g if step % 2 else model).forward(batch))  # segments, eager
            got, want = outs[0].argmax(-1), outs[1].argmax(-1)
            for row in torch.nonzero(got != want).flatten().tolist():  # only near-ties may differ
                gap = outs[1][row, want[row]] - outs[1][row, got[row]]
                assert gap < 2e-2 * outs[1][row].abs().max(), f"step {step}, row {row}"
            mismatches += int((got != want).sum())
            worst = max(worst, _rel_err(outs[0], outs[1]))
            tokens.append(outs[1].argmax(-1).tolist())
            pos = [p + 1 for p in pos]
        print(
            f"[{family} worker D={deferred}] seed {seed}: max rel err {worst:.2e}, "
            f"{mismatches} of 12 tokens differ (near-ties)"
        )
        assert worst < 2e-2  # bf16 expert weights against float32 torch experts
        assert experts.stats.calls > 0
        # calls an error left unwaited are abandoned: their slots serve the next calls
        x = torch.zeros(2, spec.hidden_size)
        ids = torch.tensor([[0] * spec.num_experts_per_tok] * 2, dtype=torch.int32)
        weights = torch.ones(2, spec.num_experts_per_tok)
        layer = spec.moe_layers[0]
        for _ in range(3):
            for pending in [experts.submit(layer, x, ids, weights) for _ in range(3)]:
                pending.abandon()
        assert experts.submit(layer, x, ids, weights).wait().shape == (2, spec.hidden_size)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("family", [f for f in ("deepseek_v3", "qwen3_moe") if f in FAMILIES])
def test_device_calls_with_deferral_give_the_calls_between_segments(
    checkpoints, seed, family, device
):
    """Device calls (on CUDA one captured graph per step; on the CPU the host runs the same
    calls in the same order) with two slots per deferring layer give exactly the logits of the
    calls between segments on the same worker, and torch experts' within bf16 tolerance."""
    path = checkpoints[family]
    deferred = CheckpointReader(path).spec.num_experts_per_tok - 1

    def load(backend):
        return load_model(path, device, torch.float32, experts=backend,
                          max_num_tokens_in_cache=512, block_size=BLOCK,
                          max_deferred_experts_per_token=deferred)  # fmt: skip

    with worker_experts(path, device) as (_, experts):
        capture = device == "cuda"
        in_graph, between = load(experts), load(experts)
        eager = load(TorchExperts(CheckpointReader(path), device, torch.float32))
        graphs = DecodeGraphs(in_graph, DecodeGraphConfig(4, 8, capture))
        assert graphs.calls is not None
        num_moes = len(graphs.moes)
        assert len(graphs.calls.layers) == 2 * num_moes - 1  # the last MoE layer defers none
        segmented = DecodeGraphs(between, DecodeGraphConfig(4, 8, capture, experts_in_graph=False))
        reference = DecodeGraphs(eager, DecodeGraphConfig(4, 8, capture=False))
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (5, 9, 2)]
        sides = []
        for model, g in ((in_graph, graphs), (between, segmented), (eager, reference)):
            kv = KVCacheManager(model.kv_cache.config)
            caches = [kv.allocate(len(p)) for p in prompts]
            model.forward(Batch(tuple(SeqInput(p, c, 0) for p, c in zip(prompts, caches))))
            sides.append((kv, g, caches))
        tokens, pos, worst = [1, 2, 3], [len(p) for p in prompts], 0.0
        for step in range(6):
            outs = []
            for kv, g, caches in sides:
                for c, p in zip(caches, pos):
                    kv.extend(c, p + 1)
                batch = Batch(tuple(SeqInput([t], c, p) for t, c, p in
                                    zip(tokens, caches, pos)))  # fmt: skip
                outs.append(g.forward(batch).clone())
            assert torch.equal(outs[0], outs[1]), f"step {step}: device calls changed the logits"
            worst = max(worst, _rel_err(outs[0], outs[2]))
            tokens, pos = outs[2].argmax(-1).tolist(), [p + 1 for p in pos]
        print(f"[device calls {family} D={deferred} {device}] seed {seed}: max rel err {worst:.2e}")
        assert worst < 2e-2
        bells = [graphs.calls.channels[0].bells(j) for j in range(len(graphs.calls.layers))]
        assert bells == [(0, 0)] * len(bells), "every slot is idle between steps"


class _Failing:
    """TorchExperts whose calls record abandon() and fail, at `fail_layer`, when waited for."""

    def __init__(self, inner: TorchExperts, fail_layer: int) -> None:
        self.inner, self.fail_layer = inner, fail_layer
        self.abandoned: list[int] = []

    def submit(self, layer, x, ids, weights):
        owner, result = self, self.inner.submit(layer, x, ids, weights)

        class Pending:
            def wait(self):
                if layer == owner.fail_layer:
                    raise RuntimeError("expert worker failed")
                return result.wait()

            def abandon(self):
                owner.abandoned.append(layer)

        return Pending()


@pytest.mark.parametrize("path_kind", ["eager", "segments"])
def test_an_expert_error_abandons_the_deferred_call_in_flight(checkpoints, seed, path_kind):
    """The next MoE layer's call fails: the deferred call still in flight is abandoned (its
    slots freed), not left for the next step, and the error comes through."""
    path = checkpoints["qwen3_moe" if "qwen3_moe" in FAMILIES else FAMILIES[0]]
    reader = CheckpointReader(path)
    moe_layers = reader.spec.moe_layers
    backend = _Failing(TorchExperts(reader, "cpu", torch.float32), fail_layer=-1)
    model = _load(path, 1, backend)
    cache = KVCacheManager(model.kv_cache.config).allocate(4)
    model.forward(Batch((SeqInput([1, 2, 3], cache, 0),)))
    backend.fail_layer = moe_layers[1]
    if path_kind == "eager":
        with pytest.raises(RuntimeError, match="expert worker failed"):
            model.forward(Batch((SeqInput([4], cache, 3),)))
    else:
        graphs = DecodeGraphs(model, DecodeGraphConfig(2, 8, capture=False))
        with pytest.raises(RuntimeError, match="expert worker failed"):
            graphs.forward(Batch((SeqInput([4], cache, 3),)))
    # the first MoE layer's deferred call, and the failing layer's own calls
    assert sorted(set(backend.abandoned)) == [moe_layers[0], moe_layers[1]]
