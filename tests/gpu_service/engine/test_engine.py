"""The engine (scheduler + runner + sampling) against transformers' own generate."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpu_service.cli import DEMO_MODEL_DIR as DEMO_MODEL
from gpu_service.engine import Engine, FinishReason, SamplingParams, SchedulerConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.engine.detokenizer import Detokenizer
from gpu_service.engine.errors import (
    EngineStopped,
    ExpertsUnavailable,
    InvalidPrompt,
    InvalidRequest,
    KVCacheTooSmall,
    PromptTooLong,
    RequestAborted,
    StepFailed,
)
from gpu_service.models import TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoint_fixtures import TinyCheckpoint
from tests.support.checkpoints import load_reference_model
from tests.support.engines import (
    _count_and_sum,
    hf_greedy,
    make_engine,
    prompts,
    run_together,
    tokens_of,
)

CHECKPOINT = TinyCheckpoint("deepseek_v3")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference_model(checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = make_engine(checkpoint)
    yield eng
    eng.stop()


def assert_greedy_under_reference(model, prompt: list[int], tokens: list[int]) -> None:
    """Each token is transformers' argmax given the prefix before it (one full forward pass)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()  # [L, V]
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - 1e-5, (
            f"token {i}: {token}, reference argmax {row.argmax()}"
        )


def test_greedy_matches_transformers_single(engine, reference, seed):
    prompt = prompts(seed)[0]
    events = engine.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert tokens_of(events) == hf_greedy(reference, prompt, 32)


def test_the_engine_times_its_own_work_between_steps_and_its_sampling(checkpoint, seed):
    eng = make_engine(checkpoint)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        start = time.perf_counter()
        for prompt in prompts(seed)[:2]:  # one after the other: nothing runs in between
            assert len(tokens_of(eng.generate(prompt, params))) == 12
        wall = time.perf_counter() - start
    finally:
        eng.stop()
    steps = sum(eng.metrics.steps.labels(mode=m)._value.get() for m in ("graph", "eager"))
    assert steps == 24  # each prompt's step samples its first token
    sampled, sample_s = _count_and_sum(eng.metrics.host_seconds, part="sample")
    between, between_s = _count_and_sum(eng.metrics.host_seconds, part="between")
    assert sampled == 24
    assert between == 22  # each request's first step followed none that left work: not counted
    assert sample_s > 0 and between_s > 0 and sample_s + between_s < wall


def test_batched_requests_match_transformers_each(engine, reference, seed):
    ps = prompts(seed + 1)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    results = run_together(engine, [(p, params) for p in ps])
    for prompt, events in zip(ps, results):
        assert tokens_of(events) == hf_greedy(reference, prompt, 32)


def test_segmented_decode_in_the_engine_matches_transformers(checkpoint, reference, seed):
    """Decode steps through DecodeGraphs (its segments run eagerly on the CPU; test_decode_graphs
    captures them on CUDA); the batch of 3 is padded to 4; prefills run eagerly."""
    ps = prompts(seed + 3)
    eng = make_engine(checkpoint, graphs=DecodeGraphConfig(max_batch=4, min_kv_bucket=8,
                                                           capture=False))  # fmt: skip
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        results = run_together(eng, [(p, params) for p in ps])
    finally:
        eng.stop()
    for prompt, events in zip(ps, results):
        assert tokens_of(events) == hf_greedy(reference, prompt, 24)
    steps = eng.metrics.steps
    assert steps.labels(mode="graph")._value.get() >= 23
    assert steps.labels(mode="eager")._value.get() >= 1  # the prefills


def test_long_prompts_are_fed_in_chunks(checkpoint, reference, seed):
    """Prompts longer than a step's token budget (7) go in over several steps next to running
    decodes: every step stays within the budget, outputs equal transformers' greedy ones, and a
    seeded sampled request gives the same tokens as in an engine that feeds it in one go."""
    ps = prompts(seed + 5, lengths=(30, 11, 3, 19))
    eng = make_engine(checkpoint, max_num_batched_tokens=7)
    sizes: list[list[int]] = []
    run = eng.runner.run

    def recording_run(step):
        sizes.append([len(s.token_ids) for s in step.seqs])
        return run(step)

    eng.runner.run = recording_run
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=77, ignore_eos=True)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        results = run_together(eng, [(p, params) for p in ps])
        chunked_sample = tokens_of(eng.generate(ps[0], seeded))
    finally:
        eng.stop()
    for prompt, events in zip(ps, results):
        assert tokens_of(events) == hf_greedy(reference, prompt, 12)
    assert max(sum(step) for step in sizes) <= 7  # 4 requests: decodes (first) fit the budget
    assert max(max(step) for step in sizes) <= 7
    assert any(len(step) > 1 and 1 in step and max(step) > 1 for step in sizes)  # mixed steps
    whole = make_engine(checkpoint)
    try:
        assert tokens_of(whole.generate(ps[0], seeded)) == chunked_sample
    finally:
        whole.stop()
    assert eng.scheduler.kv_manager.num_free_blocks == eng.scheduler.kv_manager.config.num_blocks


def run_beside_decodes(eng: Engine, decode_prompts, long_prompts, decode_tokens: int,
                       long_tokens: int) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
    """Greedy decodes first; once each has its first token, the long prompts join them. The
    tokens of every request (decodes, then long prompts) and each step's sequence lengths."""
    sizes: list[list[int]] = []
    run = eng.runner.run

    def recording_run(step):
        sizes.append([len(s.token_ids) for s in step.seqs])
        return run(step)

    eng.runner.run = recording_run
    events: list[list] = [[] for _ in range(len(decode_prompts) + len(long_prompts))]
    started = [threading.Event() for _ in decode_prompts]
    done = threading.Semaphore(0)

    def collector(i):
        def on_event(event):
            events[i].append(event)
            if event.tokens and i < len(started):
                started[i].set()
            if event.finish_reason is not None:
                done.release()

        return on_event

    decode = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(decode_prompts):
        eng.add_request(prompt, decode, collector(i))
    assert all(e.wait(120) for e in started)
    long = SamplingParams(max_tokens=long_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(long_prompts, len(decode_prompts)):
        eng.add_request(prompt, long, collector(i))
    for _ in events:
        assert done.acquire(timeout=300)
    return [tokens_of(e) for e in events], sizes


def test_chunks_beside_decodes_leave_greedy_outputs_unchanged(checkpoint, reference, seed,
                                                              device):  # fmt: skip
    """Long prompts join running decodes in two engines: the default policy (chunks sized by
    the step cost models fitted from measured steps, decode steps through DecodeGraphs,
    captured on CUDA: they calibrate the decode step's time) and a stall target so small that
    every mixed step carries only the floor (3 prompt tokens). Greedy outputs are token for
    token the same, each transformers' argmax after the ones before it."""
    graphs = DecodeGraphConfig(max_batch=4, min_kv_bucket=8, capture=device.type == "cuda")
    decode_prompts = prompts(seed + 12, lengths=(5, 8))
    long_prompts = prompts(seed + 13, lengths=(40, 29))
    runs = {}
    for name, policy in (("default", {}),
                         ("floor", dict(max_decode_stall_ms=1e-3, min_prefill_chunk_tokens=3))):
        eng = make_engine(checkpoint, graphs=graphs, device=device, max_num_batched_tokens=64,
                          **policy)  # fmt: skip
        try:
            runs[name] = run_beside_decodes(eng, decode_prompts, long_prompts, 40, 4)
        finally:
            eng.stop()
        cache = eng.scheduler.kv_manager
        assert cache.num_free_blocks == cache.config.num_blocks
        assert eng.metrics.steps.labels(mode="graph")._value.get() > 0
    outputs, sizes = runs["default"]
    assert runs["floor"][0] == outputs
    for prompt, tokens in zip(decode_prompts + long_prompts, outputs):
        assert_greedy_under_reference(reference, prompt, tokens)
    assert any(1 in step and max(step) > 1 for step in sizes)  # prompt chunks beside decodes
    mixed = [step for step in runs["floor"][1] if 1 in step and max(step) > 1]
    assert len(mixed) >= (40 + 29) // 3 and all(sum(n for n in s if n > 1) <= 3 for s in mixed)


def test_preemption_when_the_cache_is_full_keeps_outputs_exact(checkpoint, reference, seed):
    ps = prompts(seed + 2, lengths=(9, 7, 12, 6))
    eng = make_engine(checkpoint, cache_tokens=48)  # 12 blocks of 4: not all four fit at once
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        results = run_together(eng, [(p, params) for p in ps])
    finally:
        eng.stop()
    for prompt, events in zip(ps, results):
        assert len(tokens_of(events)) == 20
        assert_greedy_under_reference(reference, prompt, tokens_of(events))
    assert eng.scheduler.kv_manager.num_free_blocks == eng.scheduler.kv_manager.config.num_blocks


def test_logprobs_match_transformers(engine, reference, seed):
    prompt = prompts(seed + 3)[1]
    events = engine.generate(
        prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    )
    ids = prompt + tokens_of(events)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    sampled = [t for e in events for t in e.tokens]
    for i, token in enumerate(sampled):
        row = want[len(prompt) - 1 + i]
        assert abs(token.logprob - float(row[token.token_id])) < 1e-3
        assert token.top_logprobs[0][0] == token.token_id  # greedy picks the most likely
        assert [t for t, _ in token.top_logprobs] == torch.topk(row, 3).indices.tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine, seed):
    prompt = prompts(seed + 4)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=1234,
                            ignore_eos=True)  # fmt: skip
    alone = tokens_of(engine.generate(prompt, params))
    noisy = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    together = run_together(engine, [(prompt, params), (prompts(seed)[1], noisy)])
    assert tokens_of(together[0]) == alone
    other_seed = tokens_of(
        engine.generate(
            prompt,
            SamplingParams(
                max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=4321, ignore_eos=True
            ),
        )
    )
    assert other_seed != alone


def test_top_k_one_is_greedy(engine, seed):
    prompt = prompts(seed + 5)[2]
    greedy = tokens_of(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0)))
    top1 = tokens_of(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=2.0,
                                                            top_k=1)))  # fmt: skip
    assert top1 == greedy


def test_stop_token_ids_and_eos(engine, reference, seed):
    prompt = prompts(seed + 6)[0]
    expected = hf_greedy(reference, prompt, 8)
    stop_at = expected[3]
    events = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                    stop_token_ids=(stop_at,)))  # fmt: skip
    got = tokens_of(events)
    assert got == expected[: expected.index(stop_at) + 1]
    assert events[-1].finish_reason == FinishReason.STOP


def test_bad_requests_are_refused(engine):
    with pytest.raises(PromptTooLong, match="context length"):
        engine.add_request(list(range(100)) * 2, SamplingParams(), lambda e: None)
    with pytest.raises(InvalidPrompt, match="token ids must be in"):
        engine.add_request([5, 101], SamplingParams(), lambda e: None)
    with pytest.raises(InvalidPrompt, match="at least one token"):
        engine.add_request([], SamplingParams(), lambda e: None)
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        engine.add_request([1], SamplingParams(stop=("x",)), lambda e: None)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert engine.num_waiting == engine.num_running == 0  # refused before queueing


def test_the_kv_cache_bounds_a_request(checkpoint, seed):
    """16 token slots: a prompt of 16 tokens is refused (with its first generated token it can
    never fit); a prompt of 5 grows until every slot is used, then ends with KVCacheTooSmall."""
    eng = make_engine(checkpoint, cache_tokens=16)
    try:
        with pytest.raises(PromptTooLong, match="can never fit the KV cache"):
            eng.add_request([1] * 16, SamplingParams(), lambda e: None)
        prompt = prompts(seed + 7)[0]
        events = eng.generate(prompt, SamplingParams(max_tokens=40, temperature=0,
                                                     ignore_eos=True))  # fmt: skip
        after = eng.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        eng.stop()
    assert events[-1].finish_reason == FinishReason.ERROR
    assert isinstance(events[-1].error, KVCacheTooSmall), events[-1].error
    assert len(tokens_of(events)) == 16 - len(prompt) + 1  # the last one sampled at slot 15
    assert len(tokens_of(after)) == 3  # the engine goes on
    cache = eng.scheduler.kv_manager
    assert cache.num_free_blocks == cache.config.num_blocks


def test_failed_steps_and_a_stop_end_requests_with_typed_errors(checkpoint, seed):
    """A step that raises ends its requests with the EngineError it raised, or a StepFailed that
    chains anything else; the engine serves on. Stopping ends what runs and refuses new work."""
    eng = make_engine(checkpoint)
    prompt = prompts(seed + 8)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    try:
        raised = [ExpertsUnavailable("expert worker w gave no answer in 2 s"), KeyError("boom")]
        run = eng.runner.run

        def failing_run(step):
            raise raised.pop(0)

        eng.runner.run = failing_run
        unavailable = eng.generate(prompt, params)
        failed = eng.generate(prompt, params)
        eng.runner.run = run
        assert len(tokens_of(eng.generate(prompt, params))) == 4
        events = []
        started = threading.Event()

        def on_event(e):
            events.append(e)
            started.set()

        eng.add_request(prompt, SamplingParams(max_tokens=100, ignore_eos=True), on_event)
        assert started.wait(60)
    finally:
        eng.stop()
    assert [e.finish_reason for e in unavailable] == [FinishReason.ERROR]
    assert type(unavailable[-1].error) is ExpertsUnavailable
    assert [e.finish_reason for e in failed] == [FinishReason.ERROR]
    error = failed[-1].error
    assert isinstance(error, StepFailed) and str(error) == "KeyError: 'boom'"
    assert isinstance(error.__cause__, KeyError)
    assert events[-1].finish_reason == FinishReason.ABORT
    assert isinstance(events[-1].error, EngineStopped) and len(tokens_of(events)) < 100
    with pytest.raises(EngineStopped, match="shutting down"):
        eng.add_request(prompt, params, lambda e: None)


def test_abort_frees_the_cache(checkpoint, seed):
    eng = make_engine(checkpoint)
    try:
        events = []
        started = threading.Event()

        def on_event(e):
            events.append(e)
            started.set()

        rid = eng.add_request(prompts(seed)[0], SamplingParams(max_tokens=100, ignore_eos=True),
                              on_event)  # fmt: skip
        assert started.wait(60)
        eng.abort(rid)
        final = eng.generate([1, 2, 3], SamplingParams(max_tokens=1))  # the engine goes on
        assert final[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert events[-1].finish_reason == FinishReason.ABORT
        assert isinstance(events[-1].error, RequestAborted)
        assert len(tokens_of(events)) < 100
        cache = eng.scheduler.kv_manager
        assert cache.num_free_blocks == cache.config.num_blocks
    finally:
        eng.stop()


def test_penalties_bias_and_min_tokens_in_a_batch_match_transformers(checkpoint, reference,
                                                                    seed):  # fmt: skip
    """Greedy requests side by side, each with its own penalties, bias or min_tokens: every
    token is the argmax of transformers' logits with the plain-torch reference of
    test_sampling applied to them (given the prompt and the tokens before it)."""
    from tests.support.sampling_reference import reference_processed

    eos = 7
    experts = TorchExperts(CheckpointReader(checkpoint), "cpu", torch.float32)
    model = load_model(checkpoint, "cpu", torch.float32, experts=experts,
                       max_num_tokens_in_cache=4096, block_size=4)  # fmt: skip
    eng = Engine(model, SchedulerConfig(max_model_len=128), eos_token_ids=(eos,)).start()
    ps = prompts(seed + 11, lengths=(6, 9, 4, 7, 5))
    greedy = dict(temperature=0, max_tokens=10)
    params = [
        SamplingParams(**greedy, ignore_eos=True),
        SamplingParams(**greedy, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.7),
        SamplingParams(**greedy, ignore_eos=True, logit_bias=((int(ps[3][0]), 5.0), (9, -100.0))),
        SamplingParams(**greedy, min_tokens=6, logit_bias=((eos, 100.0),)),
    ]
    try:
        results = run_together(eng, list(zip(ps, params)))
    finally:
        eng.stop()
    for prompt, p, events in zip(ps, params, results):
        tokens = tokens_of(events)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()  # [L, V]
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i : len(prompt) + i]
            row = reference_processed(row, [p], [prompt], [tokens[:i]], (eos,))[0]
            assert row[token] >= row.max() - 1e-4, (p, i, token, int(row.argmax()))
    assert tokens_of(results[4])[-1] == eos and len(tokens_of(results[4])) == 7
    assert 9 not in tokens_of(results[3])


# ------------------------------------------------------------------------- detokenizer
def test_detokenizer_holds_back_possible_stop_string_prefixes():
    pieces = ["Hel", "lo ", "wor", "ld", "!"]
    detok = Detokenizer(lambda ids: "".join(pieces[i] for i in ids), stop=("world",))
    out = [detok.add(list(range(n))) for n in range(1, 5)]
    assert "".join(out) == "Hello "
    assert detok.stopped and detok.text == "Hello "


def test_detokenizer_looks_for_stop_strings_from_min_tokens_on():
    pieces = ["a", "STOP", "b", "c", "STOP", "d"]
    detok = Detokenizer(lambda ids: "".join(pieces[i] for i in ids), stop=("STOP",), min_tokens=3)
    out = [detok.add(list(range(n))) for n in range(1, 6)]
    assert detok.stopped and "".join(out) == detok.text == "aSTOPbc"


def _byte_decode(pieces: list[bytes]):
    """A byte-level decoder: token i is pieces[i]; invalid or unfinished UTF-8 gives U+FFFD."""
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_whole_characters_and_flushes():
    e_acute = "é".encode()
    detok = Detokenizer(_byte_decode([b"a", e_acute[:1], e_acute[1:], b"b"]))
    assert [detok.add(list(range(n))) for n in range(1, 5)] == ["a", "", "é", "b"]
    detok2 = Detokenizer(_byte_decode([b"x", b"y", b"z"]), stop=("zz",))
    assert detok2.add([0]) == "" and detok2.add([0, 1]) == "x"
    assert detok2.flush() == "y"
    unfinished = Detokenizer(_byte_decode([b"a", e_acute[:1]]))
    assert unfinished.add([0]) == "a" and unfinished.add([0, 1]) == ""
    assert unfinished.flush() == "\ufffd"  # what decoding the whole output gives


def test_detokenizer_streams_what_the_tokenizer_decodes_at_once(seed):
    """The demo model's byte-level BPE tokenizer: deltas of random outputs (partial UTF-8 tokens
    included) add up to decode(all ids), with a fixed number of decode calls per token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    gen = torch.Generator().manual_seed(seed)
    text = "Grüße, 世界! The json module: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — naïve café ☕ x = [1, 2]\n"
    for trial in range(20):
        if trial % 2:
            ids = torch.randint(0, len(tokenizer), (200,), generator=gen).tolist()
        else:
            ids = tokenizer.encode(text * 3, add_special_tokens=False)
        calls = []

        def decode(part, calls=calls):
            calls.append(len(part))
            return tokenizer.decode(part, skip_special_tokens=True)

        detok = Detokenizer(decode, stop=())
        out = "".join(detok.add(ids[: n + 1]) for n in range(len(ids))) + detok.flush()
        assert out == tokenizer.decode(ids, skip_special_tokens=True)
        assert len(calls) <= 2 * len(ids) + 2
        assert max(calls) < 64  # windows stay short: no decoding of the whole output
