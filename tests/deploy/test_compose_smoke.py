"""compose.yaml for real (issue #17): the image built from the Dockerfile, `podman-compose up` of
gpu (on the CPU), expert-0, expert-1 and prometheus, a chat completion through the published
port with the openai SDK, expert-1's worker killed (-9) and brought back by its restart policy
while a completion waits for it, another completion, then Prometheus (compose's own
prometheus.yml, Debian's binary in the base image: its image is on a registry) scrapes both
services, read through Prometheus's HTTP API. Everything the run started is gone after it.

It builds an image (minutes: tests/support/podman_compose.py says what is cached), so it runs in
CI (CI=true, as `.ci/run` is run) or with KTSERVE_COMPOSE_TEST=1, and skips, saying why, where
podman cannot run containers."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import time
import urllib.parse
import urllib.request

import openai
import pytest

from tests.support.podman_compose import (
    BASE_IMAGE,
    ComposeProject,
    Podman,
    build_image,
    container_refusal,
    ensure_base_image,
    missing_prerequisites,
    wait_for,
)
from tests.support.watched_process import REPO

RUN_ENV = "KTSERVE_COMPOSE_TEST"
SERVICES = ("expert-0", "expert-1", "gpu", "prometheus")
HELLO = [{"role": "user", "content": "Tell me about the json module."}]

pytestmark = pytest.mark.skipif(
    os.environ.get("CI") != "true" and os.environ.get(RUN_ENV) != "1",
    reason=f"builds the image (minutes): runs in CI (CI=true) or with {RUN_ENV}=1",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Steps:
    """Seconds per step, printed as a table at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []
        self._start = time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        self.rows.append((what, now - self._start))
        self._start = now

    def print(self) -> None:
        width = max(len(w) for w, _ in self.rows)
        print(f"\n| {'step':<{width}} | seconds |\n|{'-' * (width + 2)}|--------:|")
        for what, seconds in self.rows:
            print(f"| {what:<{width}} | {seconds:7.1f} |")


@pytest.fixture(scope="module")
def steps():
    s = Steps()
    yield s
    s.print()


@pytest.fixture(scope="module")
def podman(tmp_path_factory, steps):
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    podman = Podman(tmp_path_factory.mktemp("podman"))
    ensure_base_image(podman)
    steps.done(f"base image {BASE_IMAGE} (debootstrap unless kept)")
    reason = container_refusal(podman)
    if reason:
        pytest.skip(reason)
    return podman


@pytest.fixture(scope="module")
def image(podman, tmp_path_factory, steps):
    tag = f"localhost/ktserve-ci:{secrets.token_hex(4)}"
    try:
        build_image(podman, tag, tmp_path_factory.mktemp("build"))
        steps.done("image build (Dockerfile, torch CPU)")
        yield tag
    finally:
        podman.run("rmi", "-f", tag, check=False)


PROMETHEUS_OVERRIDE = """services:
  prometheus:
    image: {base}
    entrypoint: [/usr/local/bin/prometheus]
    command: [--config.file=/etc/prometheus/prometheus.yml, --storage.tsdb.path=/tmp/prometheus,
              --web.listen-address=0.0.0.0:9090]
    volumes:
      - {repo}/deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro
      - /usr/bin/prometheus:/usr/local/bin/prometheus:ro
"""


@pytest.fixture
def project(podman, image, tmp_path):
    override = tmp_path / "prometheus.override.yaml"
    override.write_text(PROMETHEUS_OVERRIDE.format(base=BASE_IMAGE, repo=REPO))
    env = {"KTSERVE_IMAGE": image, "KTSERVE_DEVICE": "cpu", "KTSERVE_PORT": str(free_port()),
           "KTSERVE_PROMETHEUS_PORT": str(free_port())}  # fmt: skip
    project = ComposeProject(podman, f"ktserve-ci-{secrets.token_hex(3)}",
                             [REPO / "compose.yaml", override], env)  # fmt: skip
    try:
        yield project
    finally:
        project.down()
        left = project.leftovers()
        assert not left, f"the compose project left {left}"


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def prometheus_query(base: str, query: str) -> list[dict]:
    status, body = get_json(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}")
    assert status == 200 and body["status"] == "success", body
    return body["data"]["result"]


def test_compose_serves_survives_an_expert_kill_and_is_scraped(project, steps):
    url = f"http://127.0.0.1:{project.env['KTSERVE_PORT']}"
    prometheus = f"http://127.0.0.1:{project.env['KTSERVE_PROMETHEUS_PORT']}"
    project.up(*SERVICES)
    wait_for(lambda: get_json(f"{url}/health")[0] == 200, 900, "the gpu service's /health")
    steps.done("podman-compose up, until /health is 200")

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    first = client.chat.completions.create(model="demo_model", messages=HELLO, max_tokens=16)
    assert first.choices[0].message.content and 1 <= first.usage.completion_tokens <= 16
    steps.done("chat completion")

    before = project.restarts("expert-1")
    os.kill(project.main_pid("expert-1"), signal.SIGKILL)
    wait_for(lambda: get_json(f"{url}/health")[0] == 503, 60, "/health to see expert-1 die")
    during = client.chat.completions.create(model="demo_model", messages=HELLO, max_tokens=8)
    assert during.usage.completion_tokens >= 1  # it waited for the restarted worker
    wait_for(lambda: get_json(f"{url}/health")[0] == 200, 120, "/health back to 200")
    assert project.restarts("expert-1") == before + 1, "restart: unless-stopped did not act"
    assert "expert worker expert-1:50061 died; waiting for it" in project.logs("gpu")
    after = client.chat.completions.create(model="demo_model", messages=HELLO, max_tokens=16)
    assert after.usage.completion_tokens >= 1
    steps.done("expert-1 killed, restarted by its policy; 2 completions")

    def all_targets_up():
        status, body = get_json(f"{prometheus}/api/v1/targets")
        targets = body["data"]["activeTargets"] if status == 200 else []
        jobs = {(t["labels"]["job"], t["labels"]["instance"]) for t in targets}
        expected = {("ktserve-gpu", "gpu:8000"), ("ktserve-expert", "expert-0:9101"),
                    ("ktserve-expert", "expert-1:9101")}  # fmt: skip
        return jobs == expected and all(t["health"] == "up" for t in targets)

    wait_for(all_targets_up, 120, "Prometheus to scrape gpu, expert-0 and expert-1")

    def values(query: str) -> dict[str, float]:
        """The latest scraped value of each series, by its instance (or address)."""
        return {r["metric"].get("address", r["metric"]["instance"]): float(r["value"][1])
                for r in prometheus_query(prometheus, query)}  # fmt: skip

    # NOTE: each is polled: a scrape from before expert-1 came back (or before its first call
    # since) says 0 for it; the next one (every 5 s) catches up
    wait_for(lambda: values("ktserve_worker_up") == {"expert-0:50061": 1, "expert-1:50061": 1},
             60, "ktserve_worker_up 1 for both workers")  # fmt: skip
    generated = sum(r.usage.completion_tokens for r in (first, during, after))
    wait_for(lambda: values("ktserve_generation_tokens_total") == {"gpu:8000": generated}, 60,
             f"ktserve_generation_tokens_total {generated}, the completions' tokens")  # fmt: skip
    wait_for(lambda: sorted(values("ktserve_expert_moe_calls_total")) == ["expert-0:9101",
             "expert-1:9101"] and min(values("ktserve_expert_moe_calls_total").values()) > 0,
             60, "each worker's MoE calls scraped")  # fmt: skip
    steps.done("Prometheus scrape of both services (HTTP API)")
