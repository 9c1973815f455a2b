"""Constrained decoding in the engine (engine/grammar.py) against an oracle: each token of a
greedy constrained request is transformers' argmax among the tokens the grammar allows, in
batches with free requests (whose outputs stay as they are alone) and through preemption. The
engine and the masks run on the `device` fixture's device (KTSERVE_TEST_DEVICE=cuda on the GPU
host), transformers on the CPU."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from gpu_service.api.tool_parsers.base import lark_json
from gpu_service.engine import FinishReason, SamplingParams
from gpu_service.engine.grammar import GrammarCompiler, GrammarError, TokenMasker
from tests.support.api_server import make_tokenizer
from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint
from tests.support.engines import make_engine, prompts, run_together, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["fox", "dog"]},
        "quick": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["animal", "quick", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, seed, tokenizer):
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds"), seed=seed,
                                vocab_size=len(tokenizer))  # fmt: skip


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def assert_masked_greedy(reference, compiler, grammar, prompt, tokens) -> None:
    """Every token is the argmax of transformers' logits once the grammar's mask is applied."""
    matcher, masker = grammar.matcher(), TokenMasker()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()  # [L, V]
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i][None].clone()  # [1, V]
        masker(row, [matcher])
        assert row[0, token] >= row.max() - 1e-4, (i, token, int(row.argmax()))
        assert matcher.accept(token)
    assert matcher.done


def test_constrained_greedy_is_the_masked_argmax_beside_free_requests(
    checkpoint, tokenizer, compiler, seed, device
):
    reference = load_reference_model(checkpoint)
    grammar = compiler.compile_lark(f"start: {lark_json(SCHEMA)}\n")
    ps = prompts(seed, lengths=(9, 7, 12, 6))
    constrained = SamplingParams(max_tokens=60, temperature=0, grammar=grammar)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eng = make_engine(checkpoint, cache_tokens=64, device=device)  # 16 blocks of 4: not all fit
    preempted = []
    schedule = eng.scheduler.schedule

    def counted():
        step = schedule()
        preempted.extend(step.preempted)
        return step

    eng.scheduler.schedule = counted
    try:
        alone = [tokens_of(eng.generate(p, free)) for p in ps[2:]]
        results = run_together(eng, [(ps[0], constrained), (ps[1], constrained),
                                     (ps[2], free), (ps[3], free)])  # fmt: skip
    finally:
        eng.stop()
    for prompt, events in zip(ps[:2], results[:2]):
        assert events[-1].finish_reason == FinishReason.STOP
        tokens = tokens_of(events)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert_masked_greedy(reference, compiler, grammar, prompt, tokens)
    assert [tokens_of(e) for e in results[2:]] == alone
    assert preempted
    assert eng.scheduler.kv_manager.num_free_blocks == eng.scheduler.kv_manager.config.num_blocks


def test_bad_grammars_raise_and_good_ones_are_cached(compiler):
    with pytest.raises(GrammarError):
        compiler.compile_lark('start: "a" undefined_rule\n')
    with pytest.raises(GrammarError):
        compiler.compile_lark(f"start: {lark_json({'type': 'nonsense'})}\n")
    text = f"start: {lark_json(SCHEMA)}\n"
    assert compiler.compile_lark(text) is compiler.compile_lark(text)


def test_masks_only_touch_rows_with_a_grammar(compiler, device):
    grammar = compiler.compile_lark('start: "fox"\n')
    logits = torch.zeros(3, compiler.vocab_size, device=device)
    TokenMasker()(logits, [None, grammar.matcher(), None])
    allowed = grammar.matcher()
    row = torch.zeros(1, compiler.vocab_size)
    TokenMasker()(row, [allowed])  # the same mask on the CPU
    assert torch.equal(torch.isfinite(logits[1]).cpu(), torch.isfinite(row[0]))
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert 0 < int(torch.isfinite(logits[1]).sum()) < compiler.vocab_size
