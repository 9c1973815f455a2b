"""Chained decode steps (engine.py, runner.py, Scheduler.chain): a decode step launched before the
last one's tokens reach the host, its tokens taken from the last one's samples on the device.

The oracles: transformers' greedy continuation (test_engine's), and the same requests in an
engine that decides every step after the last one's tokens (KTSERVE_CHAIN_DECODE_STEPS=0): seeded
sampling, logit_bias, min_tokens, stop tokens and max_tokens give the same tokens either way,
and requests that cannot chain (penalties, logprobs) break the chain and run as before. On CPU
the decode graphs' segments run eagerly (capture off); KTSERVE_TEST_DEVICE=cuda captures them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_service.config import ExpertClientConfig
from gpu_service.engine import Engine, FinishReason, SamplingParams, SchedulerConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.engine.errors import RequestAborted
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.models import TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.checkpoints import load_reference_model
from tests.support.device_decode import free_port, start_worker
from tests.support.engines import (
    _count_and_sum,
    hf_greedy,
    prompts,
    run_together,
    tokens_of,
)

CHECKPOINT = TinyCheckpoint("qwen3_moe")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference_model(checkpoint)


def make_engine(checkpoint, device, chain: bool, experts=None, cache_tokens: int = 2048,
                **scheduler) -> Engine:  # fmt: skip
    experts = experts or TorchExperts(CheckpointReader(checkpoint), device, torch.float32)
    model = load_model(checkpoint, device, torch.float32, experts=experts,
                       max_num_tokens_in_cache=cache_tokens, block_size=4)  # fmt: skip
    graphs = DecodeGraphConfig(max_batch=8, min_kv_bucket=8, capture=device == "cuda",
                               chain_steps=chain)  # fmt: skip
    config = SchedulerConfig(**{"max_model_len": 128, **scheduler})
    return Engine(model, config, graph_config=graphs).start()


def chained(engine: Engine) -> float:
    return engine.metrics.chained_steps._value.get()


def mixed_requests(seed: int, reference) -> list[tuple[list[int], SamplingParams]]:
    """Rows of every kind that chains, ending at different steps (and one that cannot chain:
    its rows break the chain while it runs)."""
    ps = prompts(seed, lengths=(5, 11, 2, 7, 3, 9, 4))
    stop_token = hf_greedy(reference, ps[0], 8)[5]  # request 4 stops at its 6th token
    # request 7 may stop at its 4th token, the first that min_tokens lets through: a chained
    # step would mask it if it counted the output as the host had it at its launch
    held = hf_greedy(reference, ps[6], 4)[3]
    return [
        (ps[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
        (
            ps[1],
            SamplingParams(
                max_tokens=19, temperature=0.9, top_p=0.9, top_k=20, seed=seed, ignore_eos=True
            ),
        ),  # fmt: skip
        (ps[2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
        (
            ps[3],
            SamplingParams(
                max_tokens=16,
                temperature=0.7,
                min_p=0.05,
                seed=seed + 1,
                logit_bias=((7, 4.0), (11, -100.0)),
                min_tokens=5,
                stop_token_ids=(3,),
                ignore_eos=True,
            ),
        ),  # fmt: skip
        (
            ps[0],
            SamplingParams(
                max_tokens=24, temperature=0, stop_token_ids=(stop_token,), ignore_eos=True
            ),
        ),  # fmt: skip
        (ps[4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
        (
            ps[5],
            SamplingParams(
                max_tokens=9,
                temperature=0.8,
                seed=seed + 2,
                ignore_eos=True,
                frequency_penalty=0.5,
                logprobs=True,
            ),
        ),  # fmt: skip
        (
            ps[6],
            SamplingParams(
                max_tokens=10, temperature=0, min_tokens=3, stop_token_ids=(held,), ignore_eos=True
            ),
        ),  # fmt: skip
    ]


def test_chained_steps_give_the_tokens_of_unchained_ones(checkpoint, reference, device, seed):
    """Batches of up to 7 rows whose requests end at different steps (max_tokens, a stop token
    mid-output), seeded sampling with every filter, logit_bias and min_tokens: the same tokens
    and finish reasons with chaining as without, greedy ones transformers' own, and every KV
    block free at the end (a chained row of an ended request gave its block back)."""
    requests = mixed_requests(seed, reference)
    results = {}
    for chain in (True, False):
        engine = make_engine(checkpoint, device, chain)
        try:
            results[chain] = run_together(engine, requests)
        finally:
            engine.stop()
        cache = engine.scheduler.kv_manager
        assert cache.num_free_blocks == cache.config.num_blocks
        assert (chained(engine) > 0) == chain
    for i, (with_chain, without) in enumerate(zip(results[True], results[False])):
        assert tokens_of(with_chain) == tokens_of(without), f"request {i}"
        assert with_chain[-1].finish_reason == without[-1].finish_reason, f"request {i}"
    assert tokens_of(results[True][0]) == hf_greedy(reference, requests[0][0], 24)
    stopped = tokens_of(results[True][4])
    assert stopped[-1] in requests[4][1].stop_token_ids and len(stopped) <= 6
    assert results[True][4][-1].finish_reason == FinishReason.STOP
    assert len(tokens_of(results[True][2])) == 2
    assert all(t.logprob is not None for e in results[True][6] for t in e.tokens)


def test_a_lone_request_chains_every_step_it_can(checkpoint, reference, device, seed):
    """24 tokens: a prefill and 23 decode steps, each started (its launch timed); the first
    decode step is decided anew, and so is each that needs the graphs of a longer context (a
    capture runs a step of its own), and the last token's step chains nothing: every other step
    is chained."""
    prompt = prompts(seed + 4, lengths=(5,))[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = make_engine(checkpoint, device, chain=True)
    try:
        tokens = tokens_of(engine.generate(prompt, params))
    finally:
        engine.stop()
    assert tokens == hf_greedy(reference, prompt, 24)
    config = engine.runner.decode_graphs.config
    buckets = {config.kv_bucket(len(prompt) + d, 4) for d in range(1, 24)}  # decode step d
    assert chained(engine) == 23 - len(buckets)
    launches, launch_s = _count_and_sum(engine.metrics.host_seconds, part="launch")
    assert launches == 23  # every decode step was started
    assert launch_s > 0
    replays, replay_s = _count_and_sum(engine.metrics.host_seconds, part="replay")
    if config.capture:  # each launch replayed its bucket's graph, within the launch's time
        assert replays == 23
        assert 0 < replay_s < launch_s
    else:  # computed eagerly: no graph to replay
        assert replays == 0


def test_a_request_that_arrives_mid_chain_is_admitted(checkpoint, reference, device, seed):
    """A chain breaks for a request waiting to be admitted: it starts within a step or two and
    both decode to transformers' greedy tokens."""
    first, second = prompts(seed + 1, lengths=(6, 9))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = make_engine(checkpoint, device, chain=True)
    events: list = []
    later: list = []
    order: list[str] = []  # which request each event was for, in the engine's order
    done = threading.Event()

    def on_first(event) -> None:
        events.append(event)
        order.append("first")
        if len(events) == 8:
            engine.add_request(second, params, on_second)

    def on_second(event) -> None:
        later.append(event)
        order.append("second")
        if event.finish_reason is not None:
            done.set()

    try:
        engine.add_request(first, params, on_first)
        assert done.wait(300)
        chained_while_alone = order.index("second")
    finally:
        engine.stop()
    assert tokens_of(events) == hf_greedy(reference, first, 30)
    assert tokens_of(later) == hf_greedy(reference, second, 30)
    assert chained(engine) > 0
    # admitted at once: its first token a few steps after its arrival (the step in flight, then
    # its prompt's chunks beside the first's decode: time-bounded), not after the first's 30th
    assert chained_while_alone <= 8 + 4


def test_an_abort_mid_chain_ends_the_request_and_frees_its_cache(checkpoint, device, seed):
    engine = make_engine(checkpoint, device, chain=True)
    events: list = []
    running = threading.Event()

    def on_event(event) -> None:
        events.append(event)
        if len(tokens_of(events)) >= 5:
            running.set()

    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        rid = engine.add_request(prompts(seed)[0], params, on_event)
        assert running.wait(120)
        engine.abort(rid)
        after = engine.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    finally:
        engine.stop()
    assert events[-1].finish_reason == FinishReason.ABORT
    assert isinstance(events[-1].error, RequestAborted)
    assert 5 <= len(tokens_of(events)) < 100
    assert len(tokens_of(after)) == 4
    cache = engine.scheduler.kv_manager
    assert cache.num_free_blocks == cache.config.num_blocks
    assert chained(engine) >= 4


def test_chain_stops_at_the_context_and_the_cache_bounds(checkpoint, device, seed):
    """A request reaching max_model_len ends with LENGTH at the same token either way, and one
    whose next block does not fit without preempting another waits for a step decided anew:
    the outputs are those of the unchained engine."""
    ps = prompts(seed + 2, lengths=(20, 23))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = {}
    for chain in (True, False):
        # 48 tokens of context; 16 blocks of 4 in all: the two requests outgrow the cache
        engine = make_engine(checkpoint, device, chain, cache_tokens=64, max_model_len=48)
        try:
            outputs[chain] = run_together(engine, [(p, params) for p in ps])
        finally:
            engine.stop()
        cache = engine.scheduler.kv_manager
        assert cache.num_free_blocks == cache.config.num_blocks
    for with_chain, without in zip(outputs[True], outputs[False]):
        assert tokens_of(with_chain) == tokens_of(without)
        assert with_chain[-1].finish_reason == FinishReason.LENGTH
        assert len(ps[0]) + len(tokens_of(with_chain)) <= 48


def test_chained_steps_with_a_worker_making_the_device_calls(checkpoint, reference, device,
                                                             seed):  # fmt: skip
    """Through a real expert worker whose calls the step makes itself (DeviceCalls; from the
    host on the CPU, as stream operations in the captured graph on CUDA): transformers' tokens,
    chained."""
    worker = start_worker(checkpoint, free_port())
    spec = CheckpointReader(checkpoint).spec
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token, wire_dtype="float32",
                           worker_timeout_s=20),  # fmt: skip
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=64,
        device=device,
    )  # fmt: skip
    ps = prompts(seed + 3, lengths=(5, 8, 3))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        engine = make_engine(checkpoint, device, chain=True, experts=experts)
        assert engine.runner.decode_graphs.calls is not None
        try:
            results = run_together(engine, [(p, params) for p in ps])
        finally:
            engine.close()
    finally:
        experts.close()
        worker.close()
    for prompt, events in zip(ps, results):
        # NOTE: the worker's experts are bf16 (the reference's float32): on the GPU host, seed
        # 1495200650 decoded 88 where the reference's top two were 8 (0.33017) and 88 (0.32857)
        assert_near_greedy(reference, prompt, tokens_of(events), WORKER_LOGIT_TOLERANCE)
    assert chained(engine) > 0  # how many: as the requests' arrivals fell between steps


WORKER_LOGIT_TOLERANCE = 5e-3


def assert_near_greedy(model, prompt: list[int], tokens: list[int], tolerance: float) -> None:
    """Each token is, given the tokens before it, transformers' argmax or within `tolerance` of
    its logit (a token fed from the wrong sample would be the argmax of another prefix)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()  # [L, V]
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - tolerance, (
            f"token {i}: {token} ({row[token]:.5f}), reference argmax {row.argmax()} "
            f"({row.max():.5f})"
        )


def test_min_tokens_holds_back_a_stop_token_exactly_as_long_when_chained(checkpoint, reference,
                                                                         device, seed):  # fmt: skip
    """min_tokens m and a stop token that greedy decoding picks first as its token m: the
    request stops right there, chained or not (a chained step samples before the host has
    appended the last step's token: rows with min_tokens pending are decided anew, or the
    stop token would be held back one token too long)."""
    for prompt in prompts(seed + 5, lengths=(9,) * 8):  # decode steps 1-7: one K bucket (16)
        greedy = hf_greedy(reference, prompt, 8)
        m = next((m for m in range(2, 8) if greedy[m] not in greedy[:m]), None)
        if m is not None:
            break
    else:
        pytest.skip("8 prompts' greedy tokens all repeat: no first occurrence after the second")
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=m,
                            stop_token_ids=(greedy[m],), ignore_eos=True)  # fmt: skip
    for chain in (True, False):
        engine = make_engine(checkpoint, device, chain)
        try:
            events = engine.generate(prompt, params)
        finally:
            engine.stop()
        assert tokens_of(events) == greedy[: m + 1], f"chain={chain}"
        assert events[-1].finish_reason == FinishReason.STOP
