"""Operability of the HTTP API: an access log line per request (and none with --no-access-log),
requests counted by method and a bounded route label, and integer fields bounded where they are
parsed (a 400 naming the field, never a 500 from a C conversion)."""

from __future__ import annotations

import random

import pytest

from gpu_service.api.access import MAX_OTHER_LABELS, RouteLabels
from gpu_service.api.app import ROUTES
from tests.support.api_server import EXACT_ENV, HELLO, TINY_FLAGS, running_server
from tests.support.checkpoint_fixtures import ServedCheckpoint

CHECKPOINT = ServedCheckpoint(dir_name="tiny-ds")


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint, *TINY_FLAGS, env=EXACT_ENV) as proc:
        yield proc


def access_lines(server) -> list[str]:
    return [line for line in server.stderr().splitlines() if "ktserve.access" in line]


def test_every_request_gets_an_access_line_with_its_tokens(server):
    before = len(access_lines(server))
    chat = {"model": "tiny", "messages": HELLO, "max_tokens": 3, "ignore_eos": True}
    status, body = server.post("/v1/chat/completions", chat)
    assert status == 200
    streamed = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True,
                "stream": True}  # fmt: skip
    conn, response = server.open_stream("/v1/completions", streamed)
    response.read()
    conn.close()
    server.get("/no/such/route")
    lines = server.wait_until(lambda: access_lines(server)[before:] if len(
        access_lines(server)) >= before + 3 else None, what="three access lines")  # fmt: skip
    prompt = body["usage"]["prompt_tokens"]
    assert "POST /v1/chat/completions 200 " in lines[0]
    assert f"prompt_tokens={prompt} completion_tokens=3" in lines[0]
    assert "POST /v1/completions 200 " in lines[1] and "completion_tokens=2" in lines[1]
    assert "GET /no/such/route 404 " in lines[2]


def test_unknown_routes_are_counted_by_a_bounded_label(server, seed):
    rng = random.Random(seed)
    for _ in range(3):
        server.get(f"/scan/{rng.randrange(10**9)}/deeper")
    metrics = server.metrics()
    scans = [k for k in metrics if k.startswith("ktserve_http_requests_total") and "/scan/" in k]
    assert len(scans) == 3 and all("method=GET" in k and "status=404" in k for k in scans)
    labels = RouteLabels(ROUTES)
    names = {labels(f"/x{i}/y") for i in range(MAX_OTHER_LABELS + 50)}
    assert len(names) == MAX_OTHER_LABELS + 1 and "other" in names  # capped
    assert labels("/v1/models/some/model") == "/v1/models/{model}"
    assert RouteLabels(ROUTES)("/a\nb/c d/e") == "/a_b/c_d"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "Hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "Hi", "seed": -(2**63) - 1}, "seed"),
        ("/v1/chat/completions", {"messages": HELLO, "seed": 2**63}, "seed"),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2**40}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HELLO, "top_k": 2**64}, "top_k"),
        ("/v1/completions", {"prompt": "Hi", "min_tokens": 2**70}, "min_tokens"),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**64]}, None),
        ("/v1/completions", {"prompt": [2**64]}, "prompt"),
        ("/v1/responses", {"input": "Hi", "top_k": 2**64}, "top_k"),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 2**64}, None),
    ],
)  # fmt: skip
def test_integer_fields_are_bounded_where_parsed(server, path, body, param):
    if path == "/v1/completions" or "messages" in body and path != "/v1/messages":
        body = {"max_tokens": 2, **body}
    status, err = server.post(path, {"model": "tiny", **body})
    assert status == 400, err
    if path == "/v1/messages":
        assert err["type"] == "error" and "max_tokens" in err["error"]["message"]
    elif param is not None:
        assert err["error"]["param"] == param, err
    # the seed within its bounds is fine
    if param == "seed":
        ok = {**body, "seed": 2**63 - 1}
        assert server.post(path, {"model": "tiny", **ok})[0] == 200


def test_no_access_log_flag_silences_it(checkpoint):
    with running_server(checkpoint, *TINY_FLAGS, "--no-access-log", env=EXACT_ENV) as proc:
        assert proc.get("/health")[0] == 200
        assert proc.post("/v1/completions", {"model": "tiny", "prompt": "Hi",
                                             "max_tokens": 1})[0] == 200  # fmt: skip
        assert not access_lines(proc)
