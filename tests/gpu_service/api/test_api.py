"""The OpenAI-compatible HTTP API against the real `openai` client, with `ktserve serve` (expert
worker, GPU service, uvicorn) running as a subprocess on a tiny checkpoint with a tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from starlette.requests import Request as StarletteRequest

from gpu_service.api.completions import CompletionChunks
from gpu_service.api.context import ApiContext
from gpu_service.api.errors import ApiError
from gpu_service.api.generation import Generation, collect
from gpu_service.api.streaming import stream_response
from gpu_service.engine import FinishReason, SampledToken, SamplingParams, TokenEvent
from gpu_service.engine.errors import (
    EngineError,
    EngineStopped,
    ExpertsUnavailable,
    InvalidPrompt,
    InvalidRequest,
    KVCacheTooSmall,
    PromptTooLong,
    RequestAborted,
    step_error,
)
from tests.support.api_server import (
    EXACT_ENV,
    EXACT_FLAGS,
    HELLO,
    NO_EOS,
    TINY_MODEL_LEN,
    openai_client,
    pid_alive,
    running_server,
    tiny_server,
)
from tests.support.checkpoint_fixtures import ServedCheckpoint

API_KEY = "test-key-123"
MAX_MODEL_LEN = TINY_MODEL_LEN
MAX_NUM_SEQS = 4


CHECKPOINT = ServedCheckpoint(dir_name="tiny-ds")


@pytest.fixture(scope="module")
def server(checkpoint):
    with tiny_server(checkpoint, API_KEY, MAX_NUM_SEQS) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, API_KEY)


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": HELLO, **kwargs})


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_non_streaming(client):
    r = chat(client, max_tokens=12, temperature=0, extra_body=NO_EOS)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.model == "tiny" and r.id.startswith("chatcmpl-")


def test_chat_streaming_matches_non_streaming(client):
    whole = chat(client, max_tokens=16, temperature=0, extra_body=NO_EOS)
    chunks = list(
        chat(
            client,
            max_tokens=16,
            temperature=0,
            extra_body=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content


def test_stream_is_openai_sse(server):
    def events_of(body: dict) -> list[dict | str]:
        conn, response = server.open_stream("/v1/chat/completions", body, headers=auth())
        try:
            assert response.status == 200
            assert response.getheader("content-type").startswith("text/event-stream")
            raw = [e for e in response.read().decode().split("\n\n") if e]
        finally:
            conn.close()
        assert all(e.startswith("data: ") for e in raw)
        assert raw[-1] == "data: [DONE]"
        return [json.loads(e[6:]) for e in raw[:-1]]

    body = {"model": "tiny", "messages": HELLO, "max_tokens": 3, "stream": True}
    chunks = events_of(body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    chunks = events_of({**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_completions_text_and_token_ids(client, server):
    r = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    ids = [5, 17, 42, 99, 7]
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.usage.prompt_tokens == len(ids)
    again = client.completions.create(
        model="tiny", prompt=[ids], max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert again.choices[0].text == by_ids.choices[0].text
    stream = client.completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, stream=True, extra_body=NO_EOS
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == by_ids.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


STOP_PROMPTS = ("Once upon a time", "Hello world!", "The quick brown fox", "Shared memory", "Hi")


def stop_string_in(text: str) -> str | None:
    """Two printable characters from the middle of text, U+FFFD not among them (an incomplete
    UTF-8 character may decode differently once its later bytes arrive)."""
    plain = [
        i
        for i in range(2, len(text) - 2)
        if all(c.isprintable() and c != "\ufffd" for c in text[i : i + 2])
    ]
    return text[plain[len(plain) // 2] :][:2] if plain else None


def with_a_stop_string(greedy_text) -> tuple[str, str, str]:
    """(prompt, greedy output, stop string in it) for the first of STOP_PROMPTS whose output
    (greedy_text(prompt)) has one: a random model's output may be all partial characters."""
    outputs = {}
    for prompt in STOP_PROMPTS:
        outputs[prompt] = text = greedy_text(prompt)
        stop = stop_string_in(text)
        if stop is not None:
            return prompt, text, stop
    raise AssertionError(f"no stop string in any greedy output: {outputs}")


def test_stop_strings_cut_the_text(client):
    def complete(prompt: str, **kwargs):
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body=NO_EOS, **kwargs
        ).choices[0]

    prompt, base, stop = with_a_stop_string(lambda p: complete(p).text)
    want = base[: base.find(stop)]
    for stops in (stop, ["\x00never\x00", stop]):
        choice = complete(prompt, stop=stops)
        assert choice.finish_reason == "stop"
        assert choice.text == want
        assert stop not in choice.text

    def chat_stream(content: str, **kwargs) -> tuple[str, str]:
        messages = [{"role": "user", "content": content}]
        chunks = list(chat(client, messages=messages, max_tokens=40, temperature=0,
                           extra_body=NO_EOS, stream=True, **kwargs))  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    content, text, stop = with_a_stop_string(lambda c: chat_stream(c)[0])
    cut, finish_reason = chat_stream(content, stop=[stop])
    assert finish_reason == "stop"
    assert cut == text[: text.find(stop)]
    assert stop not in cut


def test_seed_reproducible(client):
    kwargs = dict(max_tokens=24, temperature=1.0, top_p=0.95, extra_body={**NO_EOS, "top_k": 50})
    a = chat(client, seed=1234, logprobs=True, **kwargs)
    b = chat(client, seed=1234, logprobs=True, **kwargs)
    c = chat(client, seed=4321, logprobs=True, **kwargs)
    ids = [[t.token for t in r.choices[0].logprobs.content] for r in (a, b, c)]
    assert ids[0] == ids[1]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert ids[0] != ids[2]  # 24 draws at temperature 1 over a ~uniform random model


def test_chat_logprobs(client):
    r = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        # greedy: the sampled token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    chunks = list(
        chat(
            client,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_logprobs(client):
    r = client.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body=NO_EOS,
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    for i in range(1, 5):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert all(v <= 0 for v in lp.token_logprobs)


def test_sixteen_concurrent_requests_all_complete(client):
    def one(i: int):
        if i % 2:
            return chat(client, max_tokens=8, seed=i, extra_body=NO_EOS)
        return client.completions.create(
            model="tiny", prompt=f"Request {i}", max_tokens=8, seed=i, extra_body=NO_EOS
        )

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r.usage.completion_tokens == 8 for r in results)
    assert all(r.choices[0].finish_reason == "length" for r in results)


def test_client_disconnect_frees_the_slot(server, client):
    before = server.metrics().get("ktserve_request_success_total{finished_reason=abort}", 0.0)
    body = {
        "model": "tiny",
        "prompt": "Tell me a very long story",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    conns = []
    for _ in range(MAX_NUM_SEQS):  # every slot of the batch
        conn, response = server.open_stream("/v1/completions", body, headers=auth())
        assert response.status == 200
        response.fp.readline()  # the first chunk arrived: the request runs
        conns.append(conn)
    for conn in conns:
        conn.sock.shutdown(2)
        conn.close()
    server.wait_until(
        lambda: (
            server.metrics().get("ktserve_request_success_total{finished_reason=abort}", 0.0)
            >= before + MAX_NUM_SEQS
        ),
        timeout=20,
        what="the engine aborted the disconnected requests",
    )
    assert server.wait_until(lambda: server.health()[1]["engine"]["running"] == 0, timeout=10)
    r = chat(client, max_tokens=4, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 4


def test_client_disconnect_without_streaming_frees_the_slot(server):
    aborted = server.metrics().get("ktserve_request_success_total{finished_reason=abort}", 0.0)
    body = {"model": "tiny", "prompt": "Story:", "max_tokens": 240, "ignore_eos": True}
    conn, _ = server.open_stream("/v1/completions", body, headers=auth(), read=False)
    server.wait_until(lambda: server.health()[1]["engine"]["running"] == 1, timeout=10)
    conn.sock.shutdown(2)
    conn.close()
    server.wait_until(
        lambda: (
            server.metrics().get("ktserve_request_success_total{finished_reason=abort}", 0.0)
            == aborted + 1
        ),
        timeout=20,
        what="the engine aborted the request of the client that left",
    )
    assert server.health()[1]["engine"]["running"] == 0


def test_api_key_required(server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    status, err = server.post("/v1/chat/completions", body)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        chat(bad, max_tokens=2)
    assert exc.value.status_code == 401
    assert exc.value.body["type"] == "authentication_error"
    status, _ = server.get("/health")  # probes need no key
    assert status == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"best_guess": 1}, "best_guess"),
        ({"stream_options": {"include_usage": True, "x": 1}, "stream": True}, "stream_options.x"),
        (
            {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]},
            "messages.0.audio",
        ),
        ({"store": True}, "store"),
        ({"metadata": {"a": "b"}}, "metadata"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 150}}, "logit_bias"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 7}, "stop"),
        ({"stop": [""]}, None),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_chat_bad_parameters_are_400(server, extra, param):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2, **extra}
    status, err = server.post("/v1/chat/completions", body, headers=auth())
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"]
    if param is not None:
        assert err["error"]["param"] == param


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        {"model": "tiny"},
        {"model": "tiny", "prompt": "hi", "n": 30},
        {"model": "tiny", "prompt": "hi", "guided_json": {}},
        {"model": "tiny", "prompt": "hi", "logit_bias": {"100000": 1}},
        {"model": "tiny", "prompt": ["a", "b"]},
        {"model": "tiny", "prompt": [1, 2, 10**9]},
        {"model": "tiny", "prompt": "hi", "echo": True},
        {"model": "tiny", "prompt": "hi", "logprobs": 50},
    ],
)
def test_completion_bad_requests_are_400(server, body):
    status, err = server.post("/v1/completions", body, headers=auth())
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=[3] * MAX_MODEL_LEN, max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    assert exc.value.body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in exc.value.body["message"]


def test_metrics_count_what_was_served(server, client):
    server.wait_until(lambda: server.health()[1]["engine"]["running"] == 0, timeout=10)
    before = server.metrics()
    sent = []  # (usage, n, max_tokens, seconds as the client saw them)
    for i in range(3):
        start = time.monotonic()
        usage = chat(client, max_tokens=5 + i, extra_body=NO_EOS).usage
        sent.append((usage, 1, 5 + i, time.monotonic() - start))
    start = time.monotonic()
    usage = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=7, n=2, extra_body=NO_EOS
    ).usage
    sent.append((usage, 2, 7, time.monotonic() - start))
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # one engine request per choice; usage counts a prompt once, the engine once per choice
    prompts = [u.prompt_tokens for u, n, _, _ in sent for _ in range(n)]
    outputs = [u.completion_tokens // n for u, n, _, _ in sent for _ in range(n)]
    assert delta("ktserve_prompt_tokens_total") == sum(prompts)
    assert delta("ktserve_generation_tokens_total") == sum(outputs)
    assert delta("ktserve_request_success_total{finished_reason=length}") == 5
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):  # fmt: skip
        assert delta(f"ktserve_{name}_count") == 5, name
    assert delta("ktserve_request_prompt_tokens_sum") == sum(prompts)
    assert delta("ktserve_request_generation_tokens_sum") == sum(outputs) == 5 + 6 + 7 + 2 * 7
    assert delta("ktserve_request_params_max_tokens_sum") == 5 + 6 + 7 + 2 * 7
    assert delta("ktserve_request_params_n_count") == 4
    assert delta("ktserve_request_params_n_sum") == 5
    for histogram, values in (("request_prompt_tokens", prompts),
                              ("request_generation_tokens", outputs)):  # fmt: skip
        buckets = {k: v for k, v in after.items()
                   if k.startswith(f"ktserve_{histogram}_bucket{{")}  # fmt: skip
        assert len(buckets) > 3, histogram
        for key in buckets:
            le = float(key.split("le=")[1].rstrip("}"))
            assert delta(key) == sum(v <= le for v in values), key
    prefill = delta("ktserve_request_prefill_time_seconds_sum")
    decode = delta("ktserve_request_decode_time_seconds_sum")
    inference = delta("ktserve_request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode, rel=1e-6)
    # each phase lies inside the request's life as the server and as the client saw it
    assert inference <= delta("ktserve_e2e_request_latency_seconds_sum")
    assert inference <= sum(seconds * n for _, n, _, seconds in sent)
    assert server.model_names == {"tiny"}
    assert delta("ktserve_moe_round_trip_seconds_count") > 0
    chats = "ktserve_http_requests_total{method=POST,route=/v1/chat/completions,status=200}"
    assert delta(chats) == 3
    for name in (
        "ktserve_num_requests_running",
        "ktserve_num_requests_waiting",
        "ktserve_kv_cache_usage_perc",
        "ktserve_num_preemptions_total",
        "ktserve_request_queue_time_seconds_count",
        "ktserve_inter_token_latency_seconds_count",
        "ktserve_gpu_memory_plan_bytes{part=weights}",
        "ktserve_gpu_memory_plan_bytes{part=kv_cache}",
    ):
        assert name in after
    assert after["ktserve_kv_cache_capacity_tokens"] > 0  # the start-up memory plan


def test_health_reports_the_workers(server):
    status, body = server.health()
    assert status == 200 and body["status"] == "ok"
    assert body["engine"]["alive"]
    [worker] = body["workers"]
    assert worker["alive"] and worker["state"] == "serving" and pid_alive(worker["pid"])


def test_killed_worker_is_restarted_and_requests_wait(server, client):
    """Last in the module: kill -9 the expert worker; a request sent right away waits for the
    restarted worker (within --worker-timeout) and succeeds."""
    _, body = server.health()
    pid = body["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    r = chat(client, max_tokens=4, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 4
    print(f"request across a worker restart took {time.monotonic() - start:.1f} s")
    server.wait_until(lambda: server.health()[0] == 200, timeout=30, what="/health back to 200")
    _, body = server.health()
    log = server.stderr()
    worker_lines = "".join(line for line in log.splitlines(keepends=True) if "worker" in line)
    assert body["workers"][0]["pid"] != pid, worker_lines
    assert body["workers"][0]["restarts"] == 1, worker_lines  # NOTE: the server's account
    assert "exited with code -9; restarting it" in log


@pytest.fixture(scope="module")
def fragile_server(checkpoint):
    """No worker restarts, a short worker deadline: a dead worker means 503."""
    flags = (*EXACT_FLAGS, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "4096")
    with running_server(checkpoint, *flags, "--no-restart-workers", "--worker-timeout", "2",
                        env=EXACT_ENV) as p:  # fmt: skip
        yield p


def test_dead_worker_without_restart_is_503(fragile_server):
    server = fragile_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert client.completions.create(model="tiny-ds", prompt="hi", max_tokens=2).usage
    _, body = server.health()
    pid = body["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    server.wait_until(lambda: server.health()[0] == 503, timeout=10, what="/health 503")
    _, body = server.health()
    assert body["status"] == "unavailable" and not body["workers"][0]["alive"]
    assert body["workers"][0]["state"] == "exited"
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="tiny-ds", messages=HELLO, max_tokens=4)
    assert exc.value.status_code == 503, exc.value.body
    assert exc.value.body["code"] == "experts_unavailable"
    assert time.monotonic() - start < 20
    with pytest.raises(openai.APIStatusError) as exc:
        list(
            client.chat.completions.create(
                model="tiny-ds", messages=HELLO, max_tokens=4, stream=True
            )
        )
    assert exc.value.status_code == 503


# -------------------------------------------- engine errors through the API (in process)
class ScriptedEngine:
    """Answers add_request with the given events, or refuses it with `refusal`."""

    def __init__(self, events=(), refusal: EngineError | None = None) -> None:
        self.events = events
        self.refusal = refusal
        self.aborted: list[str] = []

    def add_request(self, prompt_ids, params, on_event, request_id):
        if self.refusal is not None:
            raise self.refusal
        for event in self.events:
            on_event(dataclasses.replace(event, request_id=request_id))
        return request_id

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def never_disconnects() -> StarletteRequest:
    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    return StarletteRequest({"type": "http", "method": "POST", "headers": []}, receive)


# (error, status, code, whether param names the prompt's field)
ENGINE_ERROR_CASES = [
    (PromptTooLong("no room"), 400, "context_length_exceeded", True),
    (InvalidPrompt("bad ids"), 400, None, True),
    (InvalidRequest("no tokenizer"), 400, None, False),
    (EngineStopped("stopping"), 503, "shutting_down", False),
    (RequestAborted("aborted"), 503, "aborted", False),
    (ExpertsUnavailable("w is gone"), 503, "experts_unavailable", False),
    (KVCacheTooSmall("outgrew"), 500, None, False),
    (step_error(KeyError("boom")), 500, None, False),
]
OPENAI_TYPES = {400: "invalid_request_error", 503: "service_unavailable_error", 500: "server_error"}


@pytest.mark.parametrize("error, status, code, about_prompt", ENGINE_ERROR_CASES)
def test_engine_errors_answer_alike_wherever_they_surface(error, status, code, about_prompt):
    """Refused by add_request, ending a non-streamed request, ending a stream at its first event
    (all three: the status) and ending it later (the error event): one table gives the answer."""
    ctx = ApiContext(engine=None, tokenizer=None, model_name="tiny", max_model_len=8,
                     worker_status=list)  # fmt: skip
    params = SamplingParams(max_tokens=2)
    token = TokenEvent("", (SampledToken(7),), text="hi")
    end = TokenEvent("", (), finish_reason=FinishReason.ERROR, error=error)
    body = {"message": str(error), "type": OPENAI_TYPES[status], "param": None, "code": code}

    async def surfaces() -> list[ApiError | list[str]]:
        out: list[ApiError | list[str]] = []
        with pytest.raises(ApiError) as refused:
            Generation(ScriptedEngine(refusal=error), [1], params, "r0", prompt_param="prompt")
        out.append(refused.value)
        with pytest.raises(ApiError) as ended:
            await collect(Generation(ScriptedEngine([token, end]), [1], params, "r1", "prompt"))
        out.append(ended.value)
        first = Generation(ScriptedEngine([end]), [1], params, "r2", "prompt")
        with pytest.raises(ApiError) as at_once:
            writers = [CompletionChunks(ctx, "r2", False)]
            await stream_response(never_disconnects(), [first], writers, include_usage=False)
        out.append(at_once.value)
        later = Generation(ScriptedEngine([token, end]), [1], params, "r3", "prompt")
        response = await stream_response(never_disconnects(), [later],
                                         [CompletionChunks(ctx, "r3", False)], False)  # fmt: skip
        out.append([chunk async for chunk in response.body_iterator])
        return out

    refused, ended, at_once, stream = asyncio.run(surfaces())
    assert refused.status == ended.status == at_once.status == status
    assert refused.body() == {"error": {**body, "param": "prompt" if about_prompt else None}}
    assert ended.body() == at_once.body() == {"error": body}
    assert [json.loads(c[6:]) for c in stream[:-1]][1:] == [{"error": body}]
    assert stream[-1] == "data: [DONE]\n\n"
    assert json.loads(stream[0][6:])["choices"][0]["text"] == "hi"
