"""compose.yaml, Prometheus' and Grafana's configs checked against the real code, so that they
cannot drift: commands parse with ktserve's own parser, addresses and ports agree, and every
metric a dashboard panel queries is exported by a real `ktserve serve` and `ktserve expert`, with
the model_name label the dashboard's variable selects."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from expert_service.config import WorkerConfig
from gpu_service.api.app import ROUTES
from gpu_service.cli import serve_config
from gpu_service.config import DEVICE_ENV
from gpu_service.serve_config import API_KEY_ENV
from gpu_service.workers.external_workers import WorkerShard, check_coverage
from ktserve import envs
from ktserve.checkpoint import parse_expert_range
from ktserve.checkpoint.spec import ModelSpec
from ktserve.cli import build_parser
from ktserve.config_flags import from_args
from ktserve.worker_token import TOKEN_CREATE_ENV, TOKEN_FILE_ENV
from tests.support.api_server import ServerProcess
from tests.support.compose_file import (
    Reset,
    environment,
    flag,
    host_path,
    load,
    mounts,
    replace_flags,
)
from tests.support.expert_procs import shm_entries
from tests.support.watched_process import CHILD_ENV, REPO, WatchedProcess

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ktserve.json"
METRIC = re.compile(r"\bktserve_\w+")


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(REPO / "compose.yaml")


def expert_services(compose: dict) -> dict[str, dict]:
    return {
        name: s for name, s in compose["services"].items() if s.get("command", [""])[0] == "expert"
    }


def addresses(gpu: dict) -> list[str]:
    return flag(gpu["command"], "--expert-address").split(",")


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_service_commands_parse_with_the_real_cli(compose, monkeypatch):
    gpu = compose["services"]["gpu"]
    argv = gpu["command"]
    model = str(host_path(REPO, gpu, argv[1]))
    monkeypatch.setenv(DEVICE_ENV, environment(gpu)[DEVICE_ENV])
    config = serve_config(build_parser().parse_args([argv[0], model, *argv[2:]]))
    assert config.gpu.device == "cuda" and config.http.host == "0.0.0.0"
    assert config.workers.expert_addresses == tuple(addresses(gpu))
    spec = ModelSpec.from_checkpoint(model)
    shards = []
    for name, service in expert_services(compose).items():
        args = build_parser().parse_args(service["command"])
        assert args.command == "expert" and service["restart"] == "unless-stopped"
        worker = from_args(WorkerConfig, args)
        assert host_path(REPO, service, worker.model) == host_path(REPO, gpu, argv[1])
        experts = parse_expert_range(args.experts)
        assert worker.expert_range == experts
        shards.append(
            WorkerShard(name, experts, spec.num_experts, spec.hidden_size, spec.moe_layers)
        )
    check_coverage(shards, spec)  # the default shards hold the default model's experts once


def test_gpu_reaches_every_expert_service_at_its_listen_port(compose):
    services = compose["services"]
    experts = expert_services(compose)
    gpu = services["gpu"]
    named = {a.rpartition(":")[0]: port_of(a) for a in addresses(gpu)}
    assert set(named) == set(experts) and len(experts) >= 2
    for name, service in experts.items():
        listen = flag(service["command"], "--listen")
        assert listen.startswith("0.0.0.0:") and port_of(listen) == named[name]
        exposed = {int(p) for p in service["expose"]}
        assert {port_of(listen), int(flag(service["command"], "--metrics-port"))} <= exposed
        assert flag(service["command"], "--metrics-host") == "0.0.0.0"
    assert set(gpu["depends_on"]) == set(experts)
    [published] = gpu["ports"]
    assert int(published.rpartition(":")[2]) == int(flag(gpu["command"], "--port")) == 8000


def test_prometheus_scrapes_the_real_metrics_endpoints(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gpu = compose["services"]["gpu"]
    assert jobs["ktserve-gpu"]["metrics_path"] == "/metrics" and "/metrics" in ROUTES
    [gpu_targets] = [t["targets"] for t in jobs["ktserve-gpu"]["static_configs"]]
    assert gpu_targets == [f"gpu:{flag(gpu['command'], '--port')}"]
    expert_targets = {t for c in jobs["ktserve-expert"]["static_configs"] for t in c["targets"]}
    assert expert_targets == {
        f"{name}:{flag(s['command'], '--metrics-port')}"
        for name, s in expert_services(compose).items()
    }
    mount = {m.target: m.source for m in mounts(compose["services"]["prometheus"])}
    assert (REPO / mount["/etc/prometheus/prometheus.yml"]).resolve() == (
        DEPLOY / "prometheus" / "prometheus.yml"
    )


def test_ktserve_containers_share_one_tmpfs_at_dev_shm(compose):
    ktserve = {"gpu", *expert_services(compose)}
    for name in ktserve:
        service = compose["services"][name]
        shm = [m.source for m in mounts(service) if m.target == "/dev/shm"]
        assert shm == ["ktshm"], f"{name} must mount the shared ktshm volume at /dev/shm"
    options = compose["volumes"]["ktshm"]["driver_opts"]
    assert options["type"] == "tmpfs"
    [uid] = re.findall(r"useradd --uid (\d+)", (REPO / "Dockerfile").read_text())
    assert {"mode=1777", f"uid={uid}", f"gid={uid}"} <= set(options["o"].split(","))


def test_gpu_reservation_and_the_cpu_override(compose):
    gpu = compose["services"]["gpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    on_cpu = load(REPO / "compose.yaml", {DEVICE_ENV: "cpu"})["services"]["gpu"]
    assert environment(on_cpu)[DEVICE_ENV] == "cpu"
    assert environment(gpu)[API_KEY_ENV] is None  # the host's, when set
    override = load(DEPLOY / "compose.cpu.yaml")["services"]["gpu"]
    assert isinstance(override["deploy"], Reset)
    assert environment(override)[DEVICE_ENV] == "cpu"


def test_the_gpu_service_passes_on_every_experiment_switch(compose):
    """Each KTSERVE_* experiment switch set where compose runs reaches `ktserve serve` (listed
    without a value: the host's, when set; unset, the fast default)."""
    gpu = environment(compose["services"]["gpu"])
    switches = {v.name for v in envs.ENV_VARS.values() if v.kind == "experiment"}
    assert switches
    assert {name: gpu.get(name, "missing") for name in switches} == dict.fromkeys(switches)


def test_grafana_provisions_the_datasource_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mount = {m.target: (REPO / m.source).resolve() for m in mounts(grafana)}
    provisioning = mount["/etc/grafana/provisioning"]
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "ktserve.yml").read_text())[
        "providers"
    ]
    assert mount[provider["options"]["path"]] == DASHBOARD.parent
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == source["uid"]
                                        for t in panel["targets"])  # fmt: skip


def dashboard_metrics() -> dict[str, set[str]]:
    """Each panel's title -> the ktserve metric names its queries use; the model_name variable's
    query as one more "panel"."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {
        p["title"]: {m for t in p["targets"] for m in METRIC.findall(t["expr"])}
        for p in dashboard["panels"]
    }
    for variable in dashboard["templating"]["list"]:
        out[f"${variable['name']}"] = set(METRIC.findall(variable["query"]["query"]))
    return out


def test_every_panel_filters_on_the_model_name_variable():
    """One variable picks the served model (label_values of a metric the GPU service exports),
    and every metric of every panel's queries is selected by it, so a Prometheus that scrapes
    two deployments shows one at a time."""
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = dashboard["templating"]["list"]
    assert variable["name"] == "model_name" and variable["type"] == "query"
    query = "label_values(ktserve_num_requests_running, model_name)"
    assert variable["query"]["query"] == variable["definition"] == query
    assert variable["datasource"]["uid"] == dashboard["panels"][0]["datasource"]["uid"]
    selector = '{model_name="$model_name"}'
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            uses = [m.end() for m in METRIC.finditer(expr)]
            assert uses, f"{panel['title']}: {expr}"
            unfiltered = [expr[:end] for end in uses if not expr.startswith(selector, end)]
            assert not unfiltered, f"{panel['title']}: not filtered on $model_name: {expr}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str, model_name: str) -> set[str]:
    """The names of the samples labeled model_name (as the dashboard's variable selects them)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        s.name
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name") == model_name
    }


def run_healthcheck(service: dict, address: str) -> subprocess.CompletedProcess:
    """The service's healthcheck command, pointed at `address` instead of its listen address."""
    kind, program, dash_c, code = service["healthcheck"]["test"]
    assert (kind, program, dash_c) == ("CMD", "python3", "-c")
    listen = f"127.0.0.1:{port_of(flag(service['command'], '--listen'))}"
    assert listen in code, f"the healthcheck does not ask {listen}, the service's listen port"
    return subprocess.run([sys.executable, "-c", code.replace(listen, address)], env=CHILD_ENV,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_every_dashboard_metric_is_exported(compose, tmp_path):
    """The compose commands themselves (container paths, addresses and ports made local), a chat
    completion, then every metric a panel queries must be in a scrape of the services."""
    wanted = dashboard_metrics()
    assert all(wanted.values()), f"panels without a ktserve metric: {wanted}"
    before = shm_entries()
    gpu = compose["services"]["gpu"]
    experts, server, local = [], None, {}
    token_file = tmp_path / "worker-token"  # the compose file's, off the shared /dev/shm
    token_env = {
        name: str(token_file) if name == TOKEN_FILE_ENV else value
        for name, value in environment(gpu).items()
        if name.startswith("KTSERVE_WORKER")
    }
    assert token_env == {TOKEN_FILE_ENV: str(token_file), TOKEN_CREATE_ENV: "1"}
    for service in expert_services(compose).values():
        assert {k: v for k, v in environment(service).items() if k in token_env} == {
            **token_env,
            TOKEN_FILE_ENV: environment(gpu)[TOKEN_FILE_ENV],
        }
    try:
        for name, service in expert_services(compose).items():
            listen, metrics = f"127.0.0.1:{free_port()}", free_port()
            argv = replace_flags(service["command"], {
                "--model": str(host_path(REPO, service, flag(service["command"], "--model"))),
                "--listen": listen, "--metrics-host": "127.0.0.1", "--metrics-port": str(metrics),
            })  # fmt: skip
            proc = WatchedProcess([sys.executable, "-m", "ktserve", *argv], token_env)
            experts.append(proc)
            local[name] = (listen, metrics)
        for proc in experts:
            proc.read_line("ktserve expert: serving", timeout=180)
        bare = WatchedProcess([sys.executable, "-m", "ktserve", "expert", "--listen",
                               f"127.0.0.1:{free_port()}"], token_env)  # fmt: skip
        experts.append(bare)
        loading = bare.read_line("listening on", timeout=60).split("listening on ")[1].split()[0]
        for name, service in expert_services(compose).items():
            healthy = run_healthcheck(service, local[name][0])
            assert healthy.returncode == 0, healthy.stderr
            assert run_healthcheck(service, loading).returncode != 0, "healthy without experts"
            assert run_healthcheck(service, f"127.0.0.1:{free_port()}").returncode != 0
        argv = gpu["command"]
        argv = replace_flags(
            [str(host_path(REPO, gpu, argv[1])), *argv[2:]],
            {"--host": "127.0.0.1", "--port": "0",
             "--expert-address": ",".join(local[a.rpartition(":")[0]][0] for a in addresses(gpu))},
        )  # fmt: skip
        server = ServerProcess(None, *argv, env={DEVICE_ENV: "cpu", **token_env}, timeout=300)
        name = flag(gpu["command"], "--served-model-name")
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model=name, max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
        )
        assert r.usage.completion_tokens >= 1
        exported = scrape(f"{server.url}/metrics", name)
        for _, metrics in local.values():
            exported |= scrape(f"http://127.0.0.1:{metrics}/metrics", name)
        missing = {t: sorted(m - exported) for t, m in wanted.items() if m - exported}
        assert not missing, f"panels query metrics nobody exports as model_name={name}: {missing}"
        assert server.terminate() == 0, server.stderr()[-3000:]
    finally:
        if server is not None:
            server.close()
        for proc in experts:
            proc.terminate()
            proc.close_streams()
    assert not shm_entries() - before
