"""What a client cannot do to `ktserve serve` (issue #17), each against a real server process: a
huge body (413, while a stream keeps its pace), more requests than the queue holds (429), a
request past its deadline, the API key on a command line or /health and /metrics without it,
and SIGTERM in the middle of streams (each ends with its tokens, an error event and [DONE])."""

from __future__ import annotations

import http.client
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.support.api_limits import FLAGS, NO_EOS, Stream
from tests.support.api_server import (
    EXACT_ENV,
    ServerProcess,
    pid_alive,
    running_server,
)
from tests.support.checkpoint_fixtures import ServedCheckpoint
from tests.support.expert_procs import shm_entries
from tests.support.watched_process import CHILD_ENV, REPO

MAX_NUM_SEQS = 2
MAX_WAITING = 1
MB = 1 << 20


CHECKPOINT = ServedCheckpoint(max_position_embeddings=1024)


@pytest.fixture(scope="module")
def api_key(seed) -> str:
    return f"key-{random.Random(seed).getrandbits(64):016x}"


@pytest.fixture(scope="module")
def server(checkpoint, api_key, tmp_path_factory):
    """The key from a 0600 file; a small queue: 2 running + 1 waiting."""
    key_file = tmp_path_factory.mktemp("secret") / "api_key"
    key_file.write_text(api_key + "\n")
    key_file.chmod(0o600)
    with running_server(checkpoint, *FLAGS, "--max-model-len", "1024", "--kv-cache-tokens",
                        "8192", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                        str(MAX_WAITING), "--api-key-file", str(key_file),
                        env=EXACT_ENV) as proc:  # fmt: skip
        proc.auth = {"Authorization": f"Bearer {api_key}"}
        yield proc


@pytest.fixture(scope="module")
def client(server, api_key):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)


def ktserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktserve", *args], cwd=REPO, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def post_chunked(server: ServerProcess, num_mb: int) -> tuple[int, dict]:
    """POST /v1/completions with a chunked body of num_mb MiB (no Content-Length)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    for name, value in {**server.auth, "Content-Type": "application/json",
                        "Transfer-Encoding": "chunked"}.items():  # fmt: skip
        conn.putheader(name, value)
    conn.endheaders()
    chunk = b"x" * MB
    try:
        for _ in range(num_mb):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered (and closed) before the rest was sent
    response = conn.getresponse()
    try:
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_huge_body_is_413_while_a_stream_keeps_its_pace(server, client):
    """A 50 MB prompt gets 413 (the openai client sends it whole: the server drops what it does
    not read), a chunked one too, and one under the body's bound but far over the context gets
    400 without being tokenized; meanwhile a stream's tokens keep coming and /health answers."""
    stream = Stream(server, 240)
    assert stream.started.wait(60) and stream.response.status == 200
    rss_before = vm_rss_mb(server.proc.pid)
    huge = "x" * (50 * MB)
    health_s = []
    t0 = time.monotonic()
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="tiny", prompt=huge, max_tokens=2)
        assert exc.value.status_code == 413 and exc.value.body["code"] == "request_too_large"
        assert "--max-request-bytes" in exc.value.body["message"]
        start = time.monotonic()
        assert server.health()[0] == 200
        health_s.append(time.monotonic() - start)
    status, error = post_chunked(server, 50)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="word " * MB, max_tokens=2)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * MB}], max_tokens=2
        )
    assert exc.value.body["code"] == "context_length_exceeded"
    assert exc.value.body["param"] == "messages"
    abuse_s = time.monotonic() - t0
    rss_growth = vm_rss_mb(server.proc.pid) - rss_before
    stream.join(120)
    times = [t for t, _ in stream.events]
    during = [b - a for a, b in zip(times, times[1:]) if a >= t0 - 1 and b <= t0 + abuse_s + 1]
    print(f"abuse took {abuse_s:.2f} s; stream gaps meanwhile: max {max(during):.3f} s over "
          f"{len(during)}; /health {max(health_s):.3f} s; RSS +{rss_growth:.0f} MB")  # fmt: skip
    payloads = stream.payloads()
    assert payloads[-1] == "[DONE]" and payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert during and max(during) < 3.0  # a 50 MB prompt tokenized used to stop it for 47-97 s
    assert max(health_s) < 3.0
    assert rss_growth < 500  # 4.5 GB, never given back, before
    stream.close()


def test_past_the_queue_bound_is_429_with_retry_after(server, client):
    """max_num_seqs running + max_waiting waiting: one more is refused at once, and served
    again once they are done."""
    streams = [Stream(server, 1000) for _ in range(MAX_NUM_SEQS)]
    assert all(s.started.wait(60) for s in streams)
    # NOTE: a waiting stream's response starts only once it runs: not read here
    body = {"model": "tiny", "prompt": "wait", "max_tokens": 4, "stream": True}
    waiting, _ = server.open_stream("/v1/completions", body, server.auth, read=False)
    server.wait_until(lambda: server.health()[1]["requests_in_flight"] == MAX_NUM_SEQS + 1,
                      timeout=30, what="every slot taken")  # fmt: skip
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model="tiny", prompt="one more", max_tokens=2)
    assert time.monotonic() - start < 5
    assert exc.value.status_code == 429 and exc.value.body["code"] == "too_many_requests"
    assert 1 <= int(exc.value.response.headers["Retry-After"]) <= 60  # test_api_limits_admission
    assert exc.value.body["type"] == "rate_limit_error"
    for s in streams:
        s.close()
    waiting.close()
    server.wait_until(lambda: server.health()[1]["requests_in_flight"] == 0, timeout=30,
                      what="the slots freed")  # fmt: skip
    assert client.completions.create(model="tiny", prompt="now", max_tokens=2).usage
    refused = "ktserve_http_requests_total{method=POST,route=/v1/completions,status=429}"
    assert server.metrics()[refused] >= 1


def test_a_request_past_its_deadline_ends_with_a_clear_error(server, client):
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="tiny", prompt="long", max_tokens=240,
                                  extra_body={"timeout": 0.5, **NO_EOS})  # fmt: skip
    assert exc.value.status_code == 504 and exc.value.body["code"] == "deadline_exceeded"
    assert "0.5 s" in exc.value.body["message"]
    assert time.monotonic() - start < 10
    stream = Stream(server, 1000, timeout=0.5)  # NOTE: 1000 tokens take seconds: it expires
    stream.join(60)
    payloads = stream.payloads()
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["code"] == "deadline_exceeded"
    assert any(p["choices"][0]["text"] for p in payloads[:-2])  # the tokens before it
    stream.close()
    server.wait_until(lambda: server.health()[1]["engine"]["running"] == 0, timeout=10,
                      what="the expired requests aborted in the engine")  # fmt: skip


def test_the_key_is_never_on_a_command_line(server, api_key):
    """Neither the server nor the workers it started show the key to `ps`; --api-key itself is
    refused without echoing its value."""
    ps = subprocess.run(["ps", "-eo", "pid,args", "ww"], capture_output=True, text=True)
    assert ps.returncode == 0
    assert str(server.proc.pid) in ps.stdout and "ktserve serve" in ps.stdout
    assert api_key not in ps.stdout
    for pid in [server.proc.pid, server.health()[1]["workers"][0]["pid"]]:
        assert api_key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    for argv in (["--api-key", api_key], [f"--api-key={api_key}"]):
        refused = ktserve("serve", *argv)
        assert refused.returncode == 2
        assert "--api-key-file" in refused.stderr and api_key not in refused.stderr
    help_text = " ".join(ktserve("serve", "--help").stdout.split())
    assert "never a flag" in help_text and "KTSERVE_API_KEY_FILE" in help_text


def test_without_the_key_health_says_only_ok_and_metrics_are_closed(server):
    status, body = server.get("/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = server.health()
    assert status == 200 and body["workers"][0]["address"] and body["workers"][0]["pid"]
    for path in ("/metrics", "/openapi.json", "/docs", "/v1/models"):
        status, body = server.get(path)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", path
    assert server.get("/metrics", server.auth)[0] == 200
    assert server.get("/openapi.json", server.auth)[0] == 200


# -------------------------------------------------------------------- SIGTERM
NUM_STREAMS = 8
SHUTDOWN_TIMEOUT_S = 4


def test_sigterm_ends_every_stream_with_its_tokens_and_done(checkpoint, api_key):
    """8 long streams, a short one and a long non-streamed request run at SIGTERM: a new request
    gets 503 in OpenAI's JSON, the short one finishes, each long stream ends after
    --shutdown-timeout with the tokens so far, an error event and [DONE], the non-streamed one
    gets 503 JSON; exit 0, with no process and no segment left. The key comes from
    the environment, and --metrics-public opens /metrics (not /health's details)."""
    before = shm_entries()
    server = ServerProcess(checkpoint, *FLAGS, "--max-model-len", "1024", "--kv-cache-tokens",
                           "16384", "--max-num-seqs", str(NUM_STREAMS + 2), "--shutdown-timeout",
                           str(SHUTDOWN_TIMEOUT_S), "--metrics-public",
                           env={**EXACT_ENV, "KTSERVE_API_KEY": api_key})  # fmt: skip
    try:
        assert server.get("/metrics")[0] == 200
        assert json.loads(server.get("/health")[1]) == {"status": "ok"}
        worker_pid = server.health()[1]["workers"][0]["pid"]
        streams = [Stream(server, 1000) for _ in range(NUM_STREAMS)]
        assert all(s.started.wait(60) for s in streams)
        whole: list = []  # a non-streamed request, running too
        body = {"model": "tiny", "prompt": "Story", "max_tokens": 1000, **NO_EOS}
        poster = threading.Thread(
            target=lambda: whole.append(server.post("/v1/completions", body, server.auth))
        )
        poster.start()
        server.wait_until(lambda: server.health()[1]["engine"]["running"] == NUM_STREAMS + 1,
                          timeout=30, what="the non-streamed request running")  # fmt: skip
        short = Stream(server, 6)  # NOTE: last: the one request that finishes while draining
        assert short.started.wait(60)
        signal_time = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.wait_until(lambda: server.get("/health")[0] == 503, timeout=10,
                          what="/health 503 while draining")  # fmt: skip
        status, err = server.post("/v1/completions", {"model": "tiny", "prompt": "late"},
                                  server.auth)  # fmt: skip
        assert status == 503 and err["error"]["code"] == "shutting_down"
        assert err["error"]["type"] == "service_unavailable_error"
        for s in [*streams, short]:
            s.join(SHUTDOWN_TIMEOUT_S + 30)
            assert not s.is_alive()
        poster.join(30)
        [(status, err)] = whole
        assert status == 503 and err["error"]["code"] == "shutting_down"
        assert server.proc.wait(60) == 0, server.stderr()[-3000:]
        short_payloads = short.payloads()
        assert short_payloads[-1] == "[DONE]"
        assert short_payloads[-2]["choices"][0]["finish_reason"] == "length"
        for s in streams:
            payloads = s.payloads()
            assert payloads[-1] == "[DONE]", payloads[-3:]
            assert payloads[-2]["error"]["code"] == "shutting_down"
            assert "--shutdown-timeout" in payloads[-2]["error"]["message"]
            texts = [p["choices"][0]["text"] for p in payloads[:-2]]
            assert texts and all(texts)
            assert s.events[-1][0] - signal_time >= SHUTDOWN_TIMEOUT_S - 0.5
            s.close()
        short.close()
        assert not pid_alive(worker_pid)
        assert f"ended {NUM_STREAMS + 1} request(s) still running" in server.stderr()
    finally:
        server.close()
    assert not shm_entries() - before


def test_sigterm_with_nothing_running_exits_at_once(checkpoint):
    server = ServerProcess(checkpoint, *FLAGS, "--max-model-len", "256", "--kv-cache-tokens",
                           "1024", "--shutdown-timeout", "60", env=EXACT_ENV)  # fmt: skip
    try:
        start = time.monotonic()
        assert server.terminate() == 0
        assert time.monotonic() - start < 30  # not the 60 s of --shutdown-timeout
    finally:
        server.close()


# -------------------------------------------------------------------- config (in process)
def test_the_key_comes_from_a_file_or_the_environment(tmp_path, api_key, caplog):
    from gpu_service.serve_config import HTTPConfig

    env = {"KTSERVE_API_KEY": "from-env"}
    assert HTTPConfig().with_api_key(env).api_key == "from-env"
    assert HTTPConfig().with_api_key({}).api_key is None
    key_file = tmp_path / "key"
    key_file.write_text(f"  {api_key}  \nsecond line\n")
    key_file.chmod(0o644)
    http = HTTPConfig(api_key_file=str(key_file)).with_api_key(env)
    assert http.api_key == api_key  # the flag's file wins over the environment
    assert api_key not in repr(http)
    assert "readable by other users" in caplog.text
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        HTTPConfig(api_key_file=str(key_file)).with_api_key({})
    with pytest.raises(ValueError, match="cannot read the API key file"):
        HTTPConfig(api_key_file=str(tmp_path / "absent")).with_api_key({})
    for bad in ({"max_request_bytes": 10}, {"max_waiting_requests": -1},
                {"request_timeout_s": 0.0}, {"shutdown_timeout_s": -1.0},
                {"request_read_timeout_s": 0.0}):  # fmt: skip
        with pytest.raises(ValueError):
            HTTPConfig(**bad)
