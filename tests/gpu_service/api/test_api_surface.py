"""The rest of the OpenAI / vLLM surface against the real `openai` client and a `ktserve serve`
subprocess: n choices (whole and streamed), min_tokens and logit_bias end to end, presence and
frequency penalties checked step by step against the model's own logprobs, and the endpoints
vLLM has beside /v1 (/v1/models/{id}, /tokenize, /detokenize, /version, HEAD /health) and
`ktserve --version`."""

from __future__ import annotations

import http.client
import random
import subprocess
import sys
from collections import Counter, defaultdict

import openai
import pytest
from transformers import AutoTokenizer

from ktserve.version import ktserve_version
from tests.support.api_server import (
    HELLO,
    NO_EOS,
    openai_client,
    tiny_server,
)
from tests.support.checkpoint_fixtures import ServedCheckpoint
from tests.support.watched_process import CHILD_ENV

KEY = "surface-key"


CHECKPOINT = ServedCheckpoint(dir_name="tiny-ds")


@pytest.fixture(scope="module")
def server(checkpoint):
    with tiny_server(checkpoint, KEY, max_num_seqs=8) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


@pytest.fixture(scope="module")
def eos(checkpoint) -> int:
    return AutoTokenizer.from_pretrained(str(checkpoint)).eos_token_id


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": HELLO, **kwargs})


def test_n_chat_choices_are_the_seeded_single_requests(client, seed):
    kwargs = dict(max_tokens=6, temperature=1.0, logprobs=True, extra_body=NO_EOS)
    r = chat(client, n=3, seed=seed, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [chat(client, seed=seed + i, **kwargs) for i in range(3)]
    tokens = [[t.token for t in c.logprobs.content] for c in r.choices]
    assert tokens == [[t.token for t in s.choices[0].logprobs.content] for s in singles]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == 18 == r.usage.total_tokens - r.usage.prompt_tokens
    assert len({tuple(t) for t in tokens}) > 1  # seeds seed, seed+1, seed+2 draw differently


def test_n_streamed_choices_match_the_whole_answer(client, seed):
    kwargs = dict(n=2, max_tokens=8, temperature=1.0, seed=seed, extra_body=NO_EOS)
    whole = chat(client, **kwargs)
    stream = chat(client, stream=True, stream_options={"include_usage": True}, **kwargs)
    text: dict[int, str] = defaultdict(str)
    finish, roles, usage = {}, Counter(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles[c.index] += c.delta.role == "assistant"
            text[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert dict(text) == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"} and roles == {0: 1, 1: 1}
    assert usage.completion_tokens == 16 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_share_the_prompts_kv_blocks(client, server, seed):
    """Choices after the first find the prompt's full blocks in the prefix cache."""
    prompt = [random.Random(seed).randrange(3, 300) for _ in range(70)]  # fresh: not cached
    hits = "ktserve_prefix_cache_hits_total{tier=gpu}"
    before = server.metrics().get(hits, 0.0)
    r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=3, seed=seed,
                                  extra_body=NO_EOS)  # fmt: skip
    assert r.usage.completion_tokens == 9 and r.usage.prompt_tokens == 70
    assert server.metrics()[hits] - before >= 2 * 64  # 4 full blocks of 16, twice


def test_n_completions(client, seed):
    r = client.completions.create(model="tiny", prompt="Hello world", n=4, max_tokens=5,
                                  seed=seed, extra_body=NO_EOS)  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20


def test_min_tokens_holds_back_an_eos_that_logit_bias_forces(client, eos, seed):
    forced = {"logit_bias": {str(eos): 100}}
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, seed=seed,
                                  extra_body=forced)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1  # EOS at once
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, seed=seed,
                                  extra_body={**forced, "min_tokens": 7})  # fmt: skip
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "stop"


def test_logit_bias_makes_greedy_pick_the_token(client, server):
    status, body = server.post("/tokenize", {"prompt": "fox", "add_special_tokens": False},
                               headers=auth())  # fmt: skip
    assert status == 200 and body["count"] >= 1
    token = body["tokens"][0]
    _, text = server.post("/detokenize", {"tokens": [token]}, headers=auth())
    r = chat(client, max_tokens=5, temperature=0, logit_bias={str(token): 100}, logprobs=True,
             extra_body=NO_EOS)  # fmt: skip
    assert [t.token for t in r.choices[0].logprobs.content] == [text["prompt"]] * 5


@pytest.fixture(scope="module")
def shared_texts(checkpoint) -> dict[int, str]:
    """The tokens whose text another token has too (byte pieces that decode to U+FFFD, ...):
    a logprob entry names a token by its text only."""
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    counts = Counter(texts.values())
    return {i: t for i, t in texts.items() if counts[t] > 1}


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.8), (-0.5, 1.2)])
def test_penalties_step_by_step_against_the_models_logprobs(client, shared_texts, presence,
                                                            frequency):  # fmt: skip
    """Greedy under penalties picks, at each step, the best of logprob + bias - penalty
    (logprobs are the model's, before bias and penalties: the same argmax as its logits,
    shifted per row). Tokens that share their text are banned (-100), so that a text names
    one token."""
    banned = set(shared_texts.values())
    r = chat(client, max_tokens=16, temperature=0, presence_penalty=presence,
             frequency_penalty=frequency, logprobs=True, top_logprobs=20,
             logit_bias={str(i): -100 for i in shared_texts}, extra_body=NO_EOS)  # fmt: skip
    seen: Counter[str] = Counter()
    for step in r.choices[0].logprobs.content:

        def score(token: str, logprob: float) -> float:
            bias = -100 if token in banned else 0
            return logprob + bias - frequency * seen[token] - presence * (seen[token] > 0)

        assert step.token not in banned
        chosen = score(step.token, step.logprob)
        assert all(score(a.token, a.logprob) <= chosen + 1e-4 for a in step.top_logprobs)
        seen[step.token] += 1


def test_model_by_id(client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_tokenize_and_detokenize_in_vllms_shapes(server, client):
    request = {"model": "tiny", "prompt": "Hello world!", "return_token_strs": True}
    status, body = server.post("/tokenize", request, headers=auth())
    assert status == 200, body
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert "".join(body["token_strs"]).endswith("world!")
    status, text = server.post("/detokenize", {"tokens": body["tokens"]}, headers=auth())
    assert status == 200 and text == {"prompt": "Hello world!"}
    status, chat_ids = server.post("/tokenize", {"messages": HELLO}, headers=auth())
    assert status == 200
    assert chat_ids["count"] == chat(client, max_tokens=1).usage.prompt_tokens
    for path, bad, param in [
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ]:
        status, err = server.post(path, bad, headers=auth())
        assert status in (400, 404) and err["error"]["param"] == param, err


def test_version_head_health_and_the_cli(server):
    status, body = server.get("/version", auth())
    assert status == 200 and body == f'{{"version":"{ktserve_version()}"}}'.encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("HEAD", "/health")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b""
    conn.close()
    out = subprocess.run([sys.executable, "-m", "ktserve", "--version"], env=CHILD_ENV,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == f"ktserve {ktserve_version()}"
