"""The sampler's math against references written here in plain torch, one row and one token at a
time: penalties (OpenAI's presence/frequency, transformers' repetition), logit_bias, min_tokens
holding back EOS, min_p / top_k / top_p as sampling distributions, and seeded rows that draw
the same tokens whatever else is in the batch. The sampler runs on the `device` fixture's device
(KTSERVE_TEST_DEVICE=cuda on the GPU host), the references on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_service.engine.logits_processors import LogitsInput, TokenHistory, process_logits
from gpu_service.engine.sampling import Sampler, SamplingParams, sample
from tests.support.sampling_reference import EOS, reference_processed

VOCAB = 48


def reference_probs(logits_row, p: SamplingParams) -> torch.Tensor:
    """The distribution one row is sampled from: temperature, min_p, top_k, top_p."""
    scores = logits_row.double() / p.temperature
    probs = torch.softmax(scores, 0)
    keep = [True] * VOCAB
    if p.min_p:
        keep = [bool(probs[t] >= p.min_p * probs.max()) for t in range(VOCAB)]
    if p.top_k:
        kth = sorted((float(scores[t]) for t in range(VOCAB) if keep[t]), reverse=True)
        kth = kth[min(p.top_k, len(kth)) - 1]
        keep = [keep[t] and float(scores[t]) >= kth for t in range(VOCAB)]
    if p.top_p < 1:
        masked = torch.tensor([float(scores[t]) if keep[t] else -math.inf for t in range(VOCAB)])
        probs = torch.softmax(masked.double(), 0)
        mass = 0.0
        for t in sorted(range(VOCAB), key=lambda t: -float(probs[t])):
            if mass >= p.top_p:
                keep[t] = False
            mass += float(probs[t])
    kept = torch.tensor([float(scores[t]) if keep[t] else -math.inf for t in range(VOCAB)])
    return torch.softmax(kept.double(), 0)


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


def history(gen, batch, length):
    return [torch.randint(0, VOCAB, (length,), generator=gen).tolist() for _ in range(batch)]


def test_penalties_bias_and_min_tokens_match_the_reference(gen, device):
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0, presence_penalty=2.0),
        SamplingParams(logit_bias=((5, 100.0), (7, -100.0), (EOS, 3.0)), min_tokens=9),
        SamplingParams(min_tokens=8, stop_token_ids=(11, 12), logit_bias=((11, 50.0),)),
        SamplingParams(min_tokens=8, ignore_eos=True, stop_token_ids=(13,)),
        SamplingParams(min_tokens=6, stop_token_ids=(14,)),  # reached: nothing held
        SamplingParams(),
    ]
    logits = (torch.randn(len(params), VOCAB, generator=gen) * 3).to(device)
    prompt_ids = history(gen, len(params), 10)
    output_ids = history(gen, len(params), 6)
    before = logits.clone()
    rows = LogitsInput.from_ids(params, prompt_ids, output_ids, VOCAB, logits.device, (EOS,))
    got = process_logits(logits, rows)
    assert got.device == logits.device
    got, logits, before = got.cpu(), logits.cpu(), before.cpu()
    want = reference_processed(logits, params, prompt_ids, output_ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert got[3, EOS] == -math.inf and got[4, 11] == -math.inf and got[4, 12] == -math.inf
    assert got[5, EOS] == logits[5, EOS] and got[5, 13] == -math.inf
    assert torch.equal(got[6], logits[6]) and torch.equal(got[7], logits[7])
    assert torch.equal(logits, before)  # the input is left as it was


def test_token_history_counts_as_the_ids_do(gen, device):
    """A request's device counts, kept up to date a few tokens at a time, are the counts of
    its ids."""
    prompt, output = history(gen, 2, 9)
    h = TokenHistory(prompt, VOCAB, device, repetition=True)
    for end in (1, 2, 5, 9):
        h.update(output[h.num_counted : end])
        counts = torch.tensor([output[:end].count(t) for t in range(VOCAB)], dtype=torch.float32)
        assert h.output_counts.device.type == device.type
        assert torch.equal(h.output_counts.cpu(), counts) and h.num_counted == end
    assert h.prompt_seen.tolist() == [t in prompt for t in range(VOCAB)]


def test_min_tokens_holds_eos_back_until_reached(device):
    logits = torch.zeros(1, VOCAB, device=device)
    logits[0, EOS] = 50.0
    sampler = Sampler((EOS,))
    p = SamplingParams(temperature=0, min_tokens=3)
    for n in range(3):
        [token] = sampler(logits, [p], [None], [[1, 2]], [[9] * n])
        assert token.token_id != EOS
    [token] = sampler(logits, [p], [None], [[1, 2]], [[9] * 3])
    assert token.token_id == EOS


def test_a_row_min_tokens_leaves_without_a_token_keeps_its_logits(device):
    """A grammar that allows only EOS, under min_tokens: EOS, not a NaN draw."""
    logits = torch.full((1, VOCAB), float("-inf"), device=device)
    logits[0, EOS] = 0.0
    p = SamplingParams(temperature=1.0, min_tokens=5)
    [token] = Sampler((EOS,))(logits, [p], [torch.Generator().manual_seed(1)], [[1]], [[]])
    assert token.token_id == EOS


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=1.3, min_p=0.05, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0),
    ],
    ids=["min_p", "min_p+top_k", "top_p", "all", "plain"],
)
def test_filters_sample_the_reference_distribution(p, seed, device):
    draws = 20000
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    logits = row.to(device).expand(draws, VOCAB)
    generators = [torch.Generator().manual_seed(seed * 7919 + i) for i in range(draws)]
    tokens = sample(logits, [p] * draws, generators)
    assert tokens.device == logits.device
    freq = torch.bincount(tokens.cpu(), minlength=VOCAB).double() / draws
    want = reference_probs(row, p)
    assert not freq[want == 0].any(), "a filtered-out token was sampled"
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq, want)


def test_greedy_rows_take_the_processed_argmax(gen, device):
    logits = torch.randn(2, VOCAB, generator=gen)
    top = int(logits[0].argmax())
    params = [SamplingParams(temperature=0, logit_bias=((top, -100.0),)),
              SamplingParams(temperature=0)]  # fmt: skip
    tokens = Sampler()(logits.to(device), params, [None, None])
    second = int(logits[0].topk(2).indices[1])
    assert [t.token_id for t in tokens] == [second, int(logits[1].argmax())]


def test_seeded_rows_draw_alike_whatever_runs_beside_them(seed, device):
    p = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, seed=seed)
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)).to(device)
    sampler = Sampler((EOS,))

    def run(batch: int) -> list[int]:
        others = torch.randn(batch, VOCAB).to(device)
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(12):
            logits = torch.cat([others, row]) if batch else row
            params = [SamplingParams(temperature=0.7)] * batch + [p]
            gens = [torch.Generator().manual_seed(i) for i in range(batch)] + [g]
            outputs = [[1]] * batch + [out]
            tokens = sampler(logits, params, gens, [[2]] * (batch + 1), outputs)
            out = out + [tokens[-1].token_id]
        return out

    alone = run(0)
    assert run(3) == alone == run(1)


def test_logprobs_are_the_models_before_penalties(gen, device):
    logits = torch.randn(1, VOCAB, generator=gen)
    p = SamplingParams(temperature=0, logprobs=True, top_logprobs=3, logit_bias=((0, 100.0),))
    [token] = Sampler()(logits.to(device), [p], [None])
    ref = torch.log_softmax(logits[0], 0)
    assert token.token_id == 0
    assert math.isclose(token.logprob, float(ref[0]), rel_tol=1e-5)
    assert [t for t, _ in token.top_logprobs] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        {"min_p": 1.5},
        {"min_tokens": 10, "max_tokens": 5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
