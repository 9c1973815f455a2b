"""Admission against a real `ktserve serve` (issue #17): a client that uploads its body slowly
holds no admission slot and gets 408 past --request-read-timeout; Retry-After on a 429 follows
the queue (waiting requests x the recent mean run time / running slots), measured against the
client's own timings of the same requests."""

from __future__ import annotations

import json
import math
import socket
import time

import openai
import pytest

from tests.support.api_limits import FLAGS, NO_EOS, Stream
from tests.support.api_server import EXACT_ENV, ServerProcess, make_served_checkpoint
from tests.support.expert_procs import shm_entries

MAX_NUM_SEQS = 1
MAX_WAITING = 8  # NOTE: Retry-After is 8 x the mean run: it tells runs of tenths of a second apart
READ_TIMEOUT_S = 3.0
OVERHEAD_S = 0.2  # most a request's latency exceeds its run in the engine, on a busy machine


@pytest.fixture(scope="module")
def server(tmp_path_factory, seed):
    """No API key; 1 running + 8 waiting; bodies must arrive within READ_TIMEOUT_S."""
    checkpoint = make_served_checkpoint(tmp_path_factory.mktemp("admission") / "tiny", seed, 1024)
    before = shm_entries()
    proc = ServerProcess(checkpoint, *FLAGS, "--max-model-len", "1024", "--kv-cache-tokens",
                         "4096", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                         str(MAX_WAITING), "--request-read-timeout",
                         str(READ_TIMEOUT_S), env=EXACT_ENV)  # fmt: skip
    proc.auth = {}
    yield proc
    assert proc.terminate() == 0, proc.stderr()[-3000:]
    proc.close()
    assert not shm_entries() - before


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


class SlowUpload:
    """A raw socket that sends a completion's headers (Expect: 100-continue) and waits for the
    server's "100 Continue": proof that the server is reading this body now."""

    def __init__(self, server: ServerProcess, body: bytes) -> None:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        self.body = body
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        self.headers_sent = time.monotonic()
        self.received = b""
        while b"\r\n\r\n" not in self.received:
            self.received += self.sock.recv(4096)
        assert self.received.startswith(b"HTTP/1.1 100 Continue"), self.received
        self.received = self.received.split(b"\r\n\r\n", 1)[1]

    def send(self, part: bytes) -> None:
        self.sock.sendall(part)

    def response(self) -> tuple[int, dict, bytes]:
        """Status, JSON body and whatever followed it until the server closed (or b"")."""
        while b"\r\n\r\n" not in self.received:
            self.received += self.sock.recv(4096)
        head, rest = self.received.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))  # fmt: skip
        while len(rest) < length:
            rest += self.sock.recv(4096)
        self.sock.settimeout(10)
        tail = b""
        try:
            while chunk := self.sock.recv(4096):
                tail += chunk
        except TimeoutError:
            tail = b"<still open>"
        return int(head.split()[1]), json.loads(rest[:length]), tail

    def close(self) -> None:
        self.sock.close()


def completion_body(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, **NO_EOS}
    ).encode()


def test_a_slow_upload_holds_no_slot_and_gets_408(server, client):
    """As many slow uploads as the server has slots, each one's body being read (100 Continue
    came): none counts in flight, a normal request is served meanwhile, a slow upload that ends
    in time is served too, and each one that does not gets 408 at --request-read-timeout with its
    connection closed."""
    body = completion_body(2)
    stalled = [SlowUpload(server, body) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
    late = SlowUpload(server, body)
    try:
        for upload in stalled:
            upload.send(body[:10])
        status, health = server.health()
        assert status == 200 and health["requests_in_flight"] == 0
        served = client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                           extra_body=NO_EOS)  # fmt: skip
        assert served.usage.completion_tokens == 2
        # NOTE: the pauses are the client's slowness (the stimulus), not a wait for the server
        for part in (body[:5], body[5:20], body[20:]):
            late.send(part)
            time.sleep(0.3)
        status, answer, _ = late.response()
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        for upload in stalled:
            status, answer, tail = upload.response()
            waited = time.monotonic() - upload.headers_sent
            assert status == 408, answer
            assert answer["error"]["code"] == "request_timeout"
            assert "--request-read-timeout" in answer["error"]["message"]
            assert tail == b"", "the connection of a timed-out upload must be closed"
            assert READ_TIMEOUT_S - 0.5 <= waited < READ_TIMEOUT_S + 10, waited
    finally:
        for upload in (*stalled, late):
            upload.close()
    key = "ktserve_http_requests_total{method=POST,route=/v1/completions,status=408}"
    timed_out = server.metrics()[key]
    assert timed_out == len(stalled)


def refused_retry_after(server: ServerProcess, client: openai.OpenAI) -> int:
    """Every slot taken (1 running stream, 8 waiting), then one more: its Retry-After. The
    streams are dropped after (aborted: their run times are not the engine's to count)."""
    running = Stream(server, 1000)
    assert running.started.wait(60)
    body = {"model": "tiny", "prompt": "wait", "max_tokens": 1000, "stream": True, **NO_EOS}
    waiting = [server.open_stream("/v1/completions", body, read=False)[0]
               for _ in range(MAX_WAITING)]  # fmt: skip
    try:
        server.wait_until(
            lambda: server.health()[1]["requests_in_flight"] == MAX_NUM_SEQS + MAX_WAITING,
            timeout=30, what="every slot taken",
        )  # fmt: skip
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model="tiny", prompt="one more", max_tokens=2)
        return int(exc.value.response.headers["Retry-After"])
    finally:
        for conn in waiting:  # NOTE: first, so that none of them runs
            conn.close()
        running.close()
        server.wait_until(lambda: server.health()[1]["requests_in_flight"] == 0, timeout=30,
                          what="the slots freed")  # fmt: skip


def expected_retry_after(latencies: list[float], num_short_before: int) -> set[int]:
    """What Retry-After may be: waiting x mean run / slots, where each run is at most the
    client's latency of it and at least that less OVERHEAD_S (the HTTP round trip, tokenizing,
    queueing); num_short_before runs of other tests, near 0 s, may share the window."""
    high = sum(latencies) / len(latencies)
    low = sum(max(x - OVERHEAD_S, 0) for x in latencies) / (len(latencies) + num_short_before)
    return {min(max(math.ceil(MAX_WAITING * m / MAX_NUM_SEQS), 1), 60) for m in (low, high)}


def test_retry_after_follows_the_queue(server, client):
    """After short requests Retry-After is small; after long ones it grows with their mean run
    time; each time as the client timed the requests."""
    latencies = []

    def timed(max_tokens: int) -> None:
        start = time.monotonic()
        r = client.completions.create(model="tiny", prompt="Once upon a time",
                                      max_tokens=max_tokens, extra_body=NO_EOS)  # fmt: skip
        latencies.append(time.monotonic() - start)
        assert r.usage.completion_tokens == max_tokens

    for _ in range(3):
        timed(1)
    short_mean = sum(latencies) / len(latencies)
    short = refused_retry_after(server, client)
    # NOTE: the engine's window holds the last 32 runs: all of this test's, and the slow-upload
    # test's two
    expected_short = expected_retry_after(latencies, num_short_before=2)
    assert min(expected_short) <= short <= max(expected_short), (short, latencies)
    while sum(latencies) / len(latencies) < 4 * short_mean + 0.25 and len(latencies) < 12:
        timed(900)
    long = refused_retry_after(server, client)
    expected = expected_retry_after(latencies, num_short_before=2)
    print(f"Retry-After {short} after short requests, {long} after long ones (expected "
          f"{sorted(expected)}; client latencies {[round(x, 2) for x in latencies]})")  # fmt: skip
    assert min(expected) <= long <= max(expected), (long, latencies)
    assert long > short
