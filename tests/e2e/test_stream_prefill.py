"""Prefill through the GPU (--stream-prefill) against the CPU-worker path and transformers: one
real `ktserve expert` subprocess per test, whose packed experts (in /dev/shm) the GPU service
maps and streams; the GPU part on KTSERVE_TEST_DEVICE (cpu here: the same code, copies are
tensor copies)."""

from __future__ import annotations

import contextlib
import socket
from contextlib import closing
from functools import partial
from pathlib import Path

import pytest
import torch

from gpu_service.experts.stream_prefill.build import AUTO_MAX_FREE_FRACTION
from gpu_service.models import Batch, SeqInput
from ktserve.protocol import expert_pb2 as pb
from ktserve.worker_token import TOKEN_ENV
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.checkpoints import load_reference_model
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401
from tests.support.parity import (
    clear_routing_prompts,
    greedy_together,
    last_logits,
    reference_greedy_check,
    relative_error,
    served_routing_margin,
)
from tests.support.worker_services import DEVICE, worker_service

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "glm4_moe")
# Streamed minus worker path, last-position logits, max|a - b| / max|b|. bf16 experts with
# float32 everywhere: both are fp32 math on the same weights (summation order apart). int8 and
# int4: the same weights, but the worker quantizes activations to int8 per token, the streamed
# path does not: measured 1.6e-3 / 1.7e-3 on deepseek_v3, bounds with margin.
BOUNDS = {"bf16": 1e-5, "int8": 2e-2, "int4": 2e-2}
if DEVICE == "cuda":  # the GPU part in float32 still rounds GEMMs to TF32 where torch allows
    BOUNDS["bf16"] = 1e-3


CHECKPOINTS = one_per_family(FAMILIES)


def service(path, worker: ExpertProcess, mode: str, **kw):
    return worker_service(path, worker, dtype="float32", kv_cache_tokens=2048, stream_prefill=mode,
                          **kw)  # fmt: skip


STREAM_LENGTHS = (21, 34, 9)


def prompts(seed: int, lengths=STREAM_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_prefill_matches_the_worker_path(family, fmt, checkpoints, seed):
    path = checkpoints[family]
    with contextlib.ExitStack() as stack:  # NOTE: closes the services, then the worker
        worker = stack.enter_context(closing(ExpertProcess("--model", str(path), "--format", fmt)))
        streamed, on_cpu = (stack.enter_context(closing(service(path, worker, mode)))
                            for mode in ("on", "off"))  # fmt: skip
        assert on_cpu.streaming is None
        if DEVICE == "cuda":
            assert streamed.streaming.stager.pinned  # the mappings registered as pinned memory
        ps = stream_prompts(family, fmt, on_cpu, seed)
        got, want = last_logits(streamed, ps).cpu(), last_logits(on_cpu, ps).cpu()
        assert streamed.streaming.steps_streamed == 1
        assert streamed.streaming.rows_streamed == sum(map(len, ps))
        assert streamed.metrics.prefill_streamed_tokens._value.get() == sum(map(len, ps))
        err = max(relative_error(got[i], want[i]) for i in range(len(ps)))
        print(f"{family} {fmt}: streamed vs worker logits relative error {err:.2e}")
        assert err < BOUNDS[fmt]
        if fmt == "bf16":  # and against transformers itself, as the exact path is
            reference = load_reference_model(path)
            for i, prompt in enumerate(ps):
                with torch.no_grad():
                    ref = reference(torch.tensor([prompt])).logits[0, -1]
                assert relative_error(got[i], ref) < 1e-3
        # greedy: the prefill streamed, decode rows on the worker; each token is the CPU
        # path's argmax (within the bound) given the same history
        outputs = greedy_together(streamed, ps, 12)
        for prompt, tokens in zip(ps, outputs):
            history = last_logits_all(on_cpu, prompt + tokens)[len(prompt) - 1 : -1]
            for i, token in enumerate(tokens):
                row = history[i]
                tol = BOUNDS[fmt] * 2 * float(row.abs().max())
                assert row[token] >= row.max() - tol, (i, token, int(row.argmax()))
            if fmt == "bf16":
                reference_greedy_check(reference, prompt, tokens)


def stream_prompts(family: str, fmt: str, on_cpu, seed: int) -> list[list[int]]:
    """The test's prompts. DeepSeek-V3 and GLM (the same router) with quantized experts: the
    worker's int8 activations move its hidden states enough to flip a near-tie of the discrete
    group/expert routing (and then the logits move by a routing change, not by rounding), so
    there only prompts whose routing, in the served quantized model itself, is clear
    (test_parity's CLEAR_ROUTING_MARGIN; the bf16 reference's margin does not carry over to int4
    weights)."""
    if family in ("deepseek_v3", "glm4_moe") and fmt != "bf16":
        return clear_routing_prompts(partial(served_routing_margin, on_cpu), seed,
                                     lengths=STREAM_LENGTHS)  # fmt: skip
    return prompts(seed)


def last_logits_all(service, prompt: list[int]) -> torch.Tensor:
    """Logits [L, V] at every position of one prompt (the CPU path: one prefill)."""
    model, kv = service.engine.model, service.engine.scheduler.kv_manager
    cache = kv.allocate(len(prompt))
    try:
        return model.forward(Batch((SeqInput(prompt, cache, 0),)), all_positions=True).cpu()
    finally:
        kv.free(cache)


@pytest.mark.parametrize("deferred", [0, 1])
def test_a_step_splits_decode_rows_to_the_worker(deferred, checkpoints, seed):
    """One step holding a decode row, a prefill chunk and another decode row: the chunk's rows
    stream, the decode rows go to the worker (its stats count them), the logits are the CPU
    path's. With expert deferral too (two calls per MoE layer, one joined at the next)."""
    path = checkpoints["deepseek_v3"]
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(closing(ExpertProcess("--model", str(path), "--format",
                                                           "bf16")))  # fmt: skip
        services = [stack.enter_context(closing(service(path, worker, mode,
                                                        max_deferred_experts_per_token=deferred)))
                    for mode in ("off", "on")]  # fmt: skip
        a, b, c = prompts(seed + 1, lengths=(7, 30, 5))
        results = []
        for s in services:
            model, kv = s.engine.model, s.engine.scheduler.kv_manager
            caches = [kv.allocate(len(p) + 1) for p in (a, c)]
            try:
                for cache, p in zip(caches, (a, c)):  # the two decodes' prompts, first
                    model.forward(Batch((SeqInput(p, cache, 0),)))
                chunk = kv.allocate(len(b))
                caches.append(chunk)
                before = worker.stub.GetStats(pb.StatsRequest(), timeout=10).tokens
                batch = Batch((SeqInput([3], caches[0], len(a)), SeqInput(b, chunk, 0),
                               SeqInput([5], caches[1], len(c))))  # fmt: skip
                results.append(model.forward(batch).cpu())
                sent = worker.stub.GetStats(pb.StatsRequest(), timeout=10).tokens - before
            finally:
                for cache in caches:
                    kv.free(cache)
            num_moe = len(model.moes)
            calls = num_moe + deferred * (num_moe - 1)  # the last MoE layer defers nothing
            rows = len(b) + 2 if s.streaming is None else 2
            assert sent == calls * rows, (s.config.stream_prefill, sent, calls, rows)
        err = relative_error(results[1], results[0])
        print(f"deferred {deferred}: streamed vs worker logits relative error {err:.2e}")
        assert err < BOUNDS["bf16"]


def test_auto_streams_from_the_cost_model_s_threshold_on_cuda_only(checkpoints):
    """--stream-prefill auto (the default): no streaming with the model on the CPU; on CUDA the
    chunks from the start-up cost model's threshold on, within auto's share of the GPU."""
    path = checkpoints["qwen3_moe"]
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(closing(ExpertProcess("--model", str(path), "--format",
                                                           "int4")))  # fmt: skip
        s = stack.enter_context(closing(service(path, worker, "auto")))
        if DEVICE != "cuda":
            assert s.streaming is None
            return
        assert s.streaming is not None, "auto declined on CUDA (the log says why)"
        cost = s.streaming.cost
        print(cost.describe())
        assert s.streaming.min_tokens == cost.min_tokens
        total = torch.cuda.get_device_properties(s.streaming.stager.device).total_memory
        assert s.streaming.memory_bytes <= AUTO_MAX_FREE_FRACTION * total


def test_streamed_steps_feed_their_own_step_cost_model(checkpoints, seed):
    """The engine's step-time models (mixed steps' chunk sizes) keep the two ways apart: a
    streamed prompt step costs its layers' copies whatever its size, and is learned by the
    streamed model only."""
    path = checkpoints["qwen3_moe"]
    prompt = prompts(seed + 2, lengths=(23,))[0]
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(closing(ExpertProcess("--model", str(path), "--format",
                                                           "bf16")))  # fmt: skip
        learned = {}
        for mode in ("off", "on"):
            s = stack.enter_context(closing(service(path, worker, mode)))
            models = s.engine.scheduler.cost_models
            before = (models.cpu.num_samples, models.streamed.num_samples)
            greedy_together(s, [prompt], 3)
            learned[mode] = (models.cpu.num_samples - before[0],
                             models.streamed.num_samples - before[1])  # fmt: skip
            streamed = s.streaming.steps_streamed if s.streaming is not None else 0
            assert streamed == (1 if mode == "on" else 0), (mode, streamed)
        # the prompt step, and the two decode steps where they run eagerly (graphed ones only
        # calibrate): streamed, the prompt step goes to the streamed model
        (off_cpu, off_streamed), (on_cpu, on_streamed) = learned["off"], learned["on"]
        assert off_streamed == 0 and on_streamed == 1, learned
        assert off_cpu == on_cpu + 1 >= 1, learned


def test_two_workers_stores_stream_as_one_layer(checkpoints, seed):
    """Experts 0-4 on one worker and 5-11 on another: the staged layer holds both stores."""
    path = checkpoints["deepseek_v3"]
    with contextlib.ExitStack() as stack:
        low = stack.enter_context(closing(ExpertProcess("--model", str(path), "--format", "int8",
                                                        "--experts", "0-4")))  # fmt: skip
        high = stack.enter_context(closing(ExpertProcess(
            "--model", str(path), "--format", "int8", "--experts", "5-11",
            env={TOKEN_ENV: low.token})))  # fmt: skip # one token for the client's two workers
        services = [stack.enter_context(closing(worker_service(
            path, low, high, dtype="float32", kv_cache_tokens=1024, stream_prefill=mode)))
            for mode in ("off", "on")]  # fmt: skip
        ps = stream_prompts("deepseek_v3", "int8", services[0], seed + 2)  # clear routings
        want, got = (last_logits(s, ps).cpu() for s in services)
        assert services[1].streaming.steps_streamed == 1
        err = max(relative_error(got[i], want[i]) for i in range(len(ps)))
        print(f"two workers, int8: streamed vs worker logits relative error {err:.2e}")
        assert err < BOUNDS["int8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_worker_s_store_is_mapped_instead(checkpoints, seed):
    """The worker is killed (its store stays, mapped by the GPU service) and another starts at
    its address with a store of its own: the call in flight is replayed on it, the next step maps
    the new store and lets go of the old one, and the logits stay the CPU path's."""
    path = checkpoints["qwen3_moe"]
    port = free_port()
    worker = ExpertProcess("--model", str(path), "--format", "int4", "--listen",
                           f"127.0.0.1:{port}")  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: worker.close())  # NOTE: whichever worker serves by then
        services = [stack.enter_context(closing(service(path, worker, mode)))
                    for mode in ("off", "on")]  # fmt: skip
        streamed = services[1].streaming
        old = Path(streamed.stager.stores[0].dir)
        ps = prompts(seed + 3)
        want = last_logits(services[0], ps).cpu()
        token = worker.token  # the one its clients have
        worker.close()  # killed: the old store is removed from /dev/shm, its pages still mapped
        worker = ExpertProcess("--model", str(path), "--format", "int4", "--listen",
                               f"127.0.0.1:{port}", env={TOKEN_ENV: token})  # fmt: skip
        for s in services:  # a decode-like step: the re-attach brings the new WorkerInfo
            last_logits(s, [ps[0][:1]])
        got = last_logits(services[1], ps).cpu()
        new = Path(streamed.stager.stores[0].dir)
        assert new != old and new.is_dir() and not old.exists()
        assert relative_error(got[0], want[0]) < BOUNDS["int4"]
        assert max(relative_error(got[i], want[i]) for i in range(len(ps))) < BOUNDS["int4"]
