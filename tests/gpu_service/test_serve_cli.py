"""`ktserve serve` as a command: its flags mapped onto the config, its refusals, and a shutdown
that leaves nothing behind (no processes, no /dev/shm segments)."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import openai
import pytest

from gpu_service.cli import DEMO_MODEL_DIR, MOVED_FLAGS, REPLACED_FLAGS, serve_config
from gpu_service.config import GPUServiceConfig
from gpu_service.serve_config import HTTPConfig, ServeConfig
from gpu_service.workers.external_workers import ExpertCoverageError, WorkerShard, check_coverage
from gpu_service.workers.plan import expert_ranges, split_experts
from ktserve import envs
from ktserve.checkpoint.spec import ModelSpec
from ktserve.cli import build_parser
from ktserve.worker_token import TOKEN_ENV, new_token
from tests.support.api_server import ServerProcess, pid_alive
from tests.support.checkpoint_fixtures import ServedCheckpoint
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess, shm_entries
from tests.support.ktserve_command import ktserve
from tests.support.watched_process import REPO

GPU_FLAGS = (
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--max-model-len",
    "128",
    "--kv-cache-tokens",
    "1024",
)
FLAGS = ("--threads", "1", "--format", "bf16", *GPU_FLAGS)  # the workers serve starts, too
CHECKPOINT = ServedCheckpoint(max_position_embeddings=128)


def test_flags_map_onto_serve_config(checkpoint, monkeypatch):
    monkeypatch.setenv("KTSERVE_API_KEY", "from-env")
    monkeypatch.delenv("KTSERVE_DEVICE", raising=False)
    moved = {envs.WIRE_DTYPE: "float32", envs.GPU_EXPERTS_REFRESH_S: "30",
             envs.MIN_PREFILL_CHUNK_TOKENS: "8"}  # fmt: skip
    for var, value in moved.items():
        monkeypatch.setenv(var.name, value)
    args = build_parser().parse_args(
        [
            "serve",
            str(checkpoint),
            "--expert-workers",
            "2",
            "--experts-per-worker",
            "0-3,4-11",
            "--no-restart-workers",
            "--worker-timeout",
            "5",
            "--max-num-seqs",
            "3",
            "--port",
            "0",
            "--format",
            "int4",
            "--threads",
            "2",
            "--max-num-batched-tokens",
            "96",
            "--gpu-experts",
            "2",
            "--no-cuda-graphs",
            "--cuda-graph-max-batch",
            "4",
            "--gpu-weight-format",
            "int4",
            "--quantize-lm-head",
            "--gpu-memory-utilization",
            "0.5",
            "--max-decode-stall-ms",
            "2.5",
        ]
    )
    config = serve_config(args)
    workers, gpu, http = config.workers, config.gpu, config.http
    assert workers.experts_per_worker == ("0-3", "4-11")
    assert expert_ranges(workers, 12) == ("0-3", "4-11")
    assert not workers.restart_workers and gpu.experts.worker_timeout_s == 5
    assert gpu.scheduler.max_num_seqs == 3 and gpu.experts.wire_dtype == "float32"
    assert workers.weight_format == "int4" and workers.threads == 2
    assert http.api_key == "from-env" and config.model_name == "tiny" and http.port == 0
    assert http.host == "127.0.0.1"
    assert gpu.scheduler.max_num_batched_tokens == 96 and not gpu.cuda_graphs
    assert gpu.gpu_experts == 2 and gpu.gpu_experts_refresh_s == 30
    assert gpu.cuda_graph_max_batch == 4
    assert gpu.gpu_weight_format == "int4" and gpu.quantize_lm_head
    assert gpu.gpu_memory_utilization == 0.5
    assert gpu.scheduler.max_decode_stall_ms == 2.5 and gpu.scheduler.max_decode_stall_s == 0.0025
    assert gpu.scheduler.min_prefill_chunk_tokens == 8
    assert gpu.model_dir == config.model_dir == str(checkpoint)
    assert gpu.experts.workers == () and gpu.scheduler.max_model_len is None
    on_workers = gpu.with_workers(("127.0.0.1:1", "127.0.0.1:2"))
    assert on_workers.experts.workers == ("127.0.0.1:1", "127.0.0.1:2")
    assert on_workers.experts.worker_timeout_s == 5 and on_workers.scheduler == gpu.scheduler
    for var in moved:
        monkeypatch.delenv(var.name)
    defaults = serve_config(build_parser().parse_args(["serve", str(checkpoint)]))
    assert defaults == ServeConfig(
        gpu=GPUServiceConfig(model_dir=str(checkpoint)), http=HTTPConfig(api_key="from-env")
    )
    assert split_experts(12, 5) == ("0-2", "3-5", "6-7", "8-9", "10-11")
    with pytest.raises(ValueError, match="config.json"):
        serve_config(build_parser().parse_args(["serve", str(REPO / "tests")]))


def test_no_model_serves_the_demo_or_says_how_to_pass_one(tmp_path):
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        result = ktserve("serve", "--port", "0")
        assert result.returncode == 2
        assert "no model given" in result.stderr
        assert "ktserve serve /path/to/model" in result.stderr
        return
    before = shm_entries()
    server = ServerProcess(None, "--threads", "1", "--max-model-len", "256", timeout=300)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEMO_MODEL_DIR.name]
        r = client.chat.completions.create(
            model=DEMO_MODEL_DIR.name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        assert r.usage.completion_tokens <= 4
    finally:
        assert server.terminate() == 0
        server.close()
    assert not shm_entries() - before


@pytest.mark.parametrize(
    "args, message",
    [
        (("--gpu-experts", "-1"), "--gpu-experts must be >= 0"),
        (("--expert-placement", "/nonexistent.json"), "is not a file"),
        (("--expert-workers", "0"), "--expert-workers must be >= 1"),
        (("--expert-workers", "2", "--experts-per-worker", "0-11"), "one range per worker"),
        (("--expert-workers", "50"), "use at most 12 workers"),
        (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization must be in (0, 1]"),
        (("--gpu-weight-format", "bf16", "--quantize-lm-head"), "--quantize-lm-head needs"),
        (("--quantize-lm-head",), "auto chose bf16 here"),
        (("--max-decode-stall-ms", "0"), "--max-decode-stall-ms must be > 0"),
        *(((flag, "1"), f"replaced by {new}") for flag, new in REPLACED_FLAGS.items()),
        *(((flag, "1"), f"variable {var} instead") for flag, var in MOVED_FLAGS.items()),
    ],
)
def test_bad_flags_exit_2_with_a_message(checkpoint, args, message):
    result = ktserve("serve", str(checkpoint), "--port", "0", *FLAGS, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(
    "var, value, message",
    [
        (
            envs.MAX_DEFERRED_EXPERTS_PER_TOKEN,
            "-1",
            "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN must be >= 0",
        ),
        (envs.MAX_DEFERRED_EXPERTS_PER_TOKEN, "9", "must be below the model's"),
        (envs.MIN_PREFILL_CHUNK_TOKENS, "0", "KTSERVE_MIN_PREFILL_CHUNK_TOKENS must be >= 1"),
        (envs.WIRE_DTYPE, "float16", "KTSERVE_WIRE_DTYPE='float16': expected one of"),
    ],
)
def test_bad_variables_exit_2_with_a_message(checkpoint, var, value, message):
    result = ktserve("serve", str(checkpoint), "--port", "0", *FLAGS, env={var.name: value})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_missing_tokenizer_and_busy_port_exit_2(tmp_path, checkpoint, seed):
    bare = make_tiny_checkpoint("deepseek_v3", tmp_path / "bare", seed=seed)
    result = ktserve("serve", str(bare), "--port", "0", *FLAGS)
    assert result.returncode == 2 and "tokenizer" in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = ktserve("serve", str(checkpoint), "--port", str(port), *FLAGS)
    assert result.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr


def worker_pids(server: ServerProcess) -> list[int]:
    return [
        int(m) for line in server.output for m in re.findall(r"\[expert \d+\].*pid (\d+)", line)
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything(checkpoint, sig):
    before = shm_entries()
    server = ServerProcess(checkpoint, *FLAGS, "--expert-workers", "2")
    try:
        _, health = server.health()
        pids = [w["pid"] for w in health["workers"]]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        assert len(shm_entries() - before) > 0  # the GPU side's channels exist while it serves
        # the workers listen on Unix sockets in a directory no other user may enter, not TCP
        sockets = [Path(w["address"].removeprefix("unix:")) for w in health["workers"]]
        assert all(w["address"].startswith("unix:") and p.is_socket() for w, p in
                   zip(health["workers"], sockets))  # fmt: skip
        assert {p.parent.stat().st_mode & 0o777 for p in sockets} == {0o700}
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert r.usage.completion_tokens <= 3
        server.proc.send_signal(sig)
        assert server.proc.wait(60) == 0, server.stderr()[-3000:]
        assert "ktserve.serve INFO stopped" in server.stderr()
    finally:
        server.close()
    assert not any(pid_alive(p) for p in pids)
    assert not shm_entries() - before
    assert not sockets[0].parent.exists()


def running(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_kill_9_leaves_no_segments_behind(checkpoint):
    """kill -9 of `ktserve serve`: its workers (SIGTERM from the kernel as their parent dies)
    unlink the segments their dead producer cannot, then exit."""
    before = shm_entries()
    server = ServerProcess(checkpoint, *FLAGS, "--expert-workers", "1")
    try:
        _, health = server.health()
        pids = [w["pid"] for w in health["workers"]]
        assert pids and len(shm_entries() - before) > 0
        socket_dir = Path(health["workers"][0]["address"].removeprefix("unix:")).parent
        server.proc.kill()
        server.proc.wait(30)
        # NOTE: orphans are reaped by PID 1, in its own time: a zombie has exited
        server.wait_until(lambda: not any(running(p) for p in pids), 60, "the workers' exit")
        server.wait_until(lambda: not shm_entries() - before, 10, "no segments left")
        assert not socket_dir.exists(), "the workers' socket directory was left behind"
    finally:
        server.close()


def test_sigterm_while_loading_stops_everything(checkpoint):
    before = shm_entries()
    server = ServerProcess(checkpoint, *FLAGS, "--expert-workers", "2", wait=False)
    try:
        pids = server.wait_until(
            lambda: len(worker_pids(server)) == 2 and worker_pids(server),
            timeout=120,
            what="both workers started",
        )
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.stderr()[-3000:]
    finally:
        server.close()
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)
    assert not shm_entries() - before


def test_worker_that_cannot_load_fails_the_start(checkpoint):
    before = shm_entries()
    result = ktserve(
        "serve", str(checkpoint), "--port", "0", *FLAGS, "--experts-per-worker", "0-99"
    )
    assert result.returncode == 1, result.stderr
    assert "expert worker 0 (experts 0-99) exited with code" in result.stderr
    assert not shm_entries() - before


def test_expert_addresses_map_onto_serve_config(checkpoint, monkeypatch):
    monkeypatch.setenv("KTSERVE_DEVICE", "cpu")
    parse = build_parser().parse_args
    args = parse(["serve", str(checkpoint), "--expert-address", "a:1, b:2", "--expert-address",
                  "unix:/run/w.sock"])  # fmt: skip
    config = serve_config(args)
    assert config.workers.expert_addresses == ("a:1", "b:2", "unix:/run/w.sock")
    assert config.gpu.device == "cpu"
    assert serve_config(parse(["serve", str(checkpoint)])).workers.expert_addresses is None
    for flags, message in [
        (["--threads", "2"], "--threads configures the expert workers ktserve serve starts"),
        (["--expert-workers", "2", "--format", "int4"], "--expert-workers, --format configure"),
        (["--expert-address", "a:1"], "names a:1 more than once"),
    ]:
        with pytest.raises(ValueError, match=message):
            serve_config(parse(["serve", str(checkpoint), "--expert-address", "a:1", *flags]))
    for bad in ("nohost", "a:0", "a:port", ":80"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            serve_config(parse(["serve", str(checkpoint), "--expert-address", bad]))


def test_coverage_check_names_missing_and_doubled_experts(checkpoint):
    spec = ModelSpec.from_checkpoint(checkpoint)
    assert spec.num_experts == 12

    def shard(address, start, stop, **changes):
        model = dict(num_experts=12, hidden_size=spec.hidden_size, moe_layers=spec.moe_layers)
        return WorkerShard(address, range(start, stop), **{**model, **changes})

    check_coverage([shard("a:1", 0, 5), shard("b:1", 5, 12)], spec)
    check_coverage([shard("a:1", 0, 12)], spec)
    with pytest.raises(ExpertCoverageError, match=r"no worker holds experts 5-9, 11 \(a:1 holds"):
        check_coverage([shard("a:1", 0, 5), shard("b:1", 10, 11)], spec)
    with pytest.raises(ExpertCoverageError, match=r"experts 4-5 are held by more than one worker"):
        check_coverage([shard("a:1", 0, 6), shard("b:1", 4, 12)], spec)
    with pytest.raises(ExpertCoverageError, match="b:1 serves another model: 16 experts"):
        check_coverage([shard("a:1", 0, 12), shard("b:1", 0, 16, num_experts=16)], spec)


# the token of the workers started by hand, which the tests' `ktserve serve` is given too
HAND_TOKEN = {TOKEN_ENV: new_token()}


def expert_worker(checkpoint, experts: str, *flags: str) -> ExpertProcess:
    return ExpertProcess("--model", str(checkpoint), "--experts", experts, "--format", "bf16",
                         *flags, env=HAND_TOKEN)  # fmt: skip


HELLO = [{"role": "user", "content": "Hello"}]


def test_serve_on_external_workers_survives_a_worker_restart(checkpoint):
    """Two `ktserve expert` started by hand; serve --expert-address; kill -9 one: requests get 503
    after --worker-timeout; a new worker on the same address: the next request succeeds."""
    before = shm_entries()
    workers = [expert_worker(checkpoint, "0-5"), expert_worker(checkpoint, "6-11")]
    addresses = [w.address for w in workers]
    server = None
    try:
        server = ServerProcess(checkpoint, *GPU_FLAGS, "--worker-timeout", "4", "--expert-address",
                               addresses[0], "--expert-address", addresses[1],
                               env=HAND_TOKEN)  # fmt: skip
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 4
        status, health = server.health()
        assert status == 200 and [w["experts"] for w in health["workers"]] == ["0-5", "6-11"]
        assert (
            server.metrics()[f"ktserve_worker_up{{address={addresses[1]},experts=6-11,worker=1}}"]
            == 1.0
        )

        workers[1].kill()
        server.wait_until(lambda: server.health()[0] == 503, timeout=10, what="/health 503")
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as exc:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
        waited = time.monotonic() - start
        assert exc.value.status_code == 503 and exc.value.body["code"] == "experts_unavailable"
        assert 3.0 <= waited < 20, f"the request waited {waited:.1f} s for --worker-timeout 4"
        assert (
            server.metrics()[f"ktserve_worker_up{{address={addresses[1]},experts=6-11,worker=1}}"]
            == 0.0
        )

        workers[1].close()
        workers[1] = expert_worker(checkpoint, "6-11", "--listen", addresses[1])
        r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
        assert r.usage.completion_tokens <= 4
        server.wait_until(lambda: server.health()[0] == 200, timeout=10, what="/health 200")
        assert server.terminate() == 0, server.stderr()[-3000:]
        assert f"expert worker {addresses[1]} died; waiting for it" in server.stderr()
        assert all(w.proc.poll() is None for w in workers), "serve must leave its workers alone"
    finally:
        if server is not None:
            server.close()
        for worker in workers:
            worker.close()
    assert not shm_entries() - before


def test_serve_refuses_workers_that_do_not_cover_every_expert(checkpoint):
    before = shm_entries()
    worker = expert_worker(checkpoint, "0-5")
    try:
        result = ktserve("serve", str(checkpoint), "--port", "0", *GPU_FLAGS,
                         "--expert-address", worker.address, env=HAND_TOKEN)  # fmt: skip
    finally:
        worker.close()
    assert result.returncode == 2, result.stderr
    assert "no worker holds experts 6-11" in result.stderr
    assert f"{worker.address} holds 0-5" in result.stderr
    assert not shm_entries() - before


def test_serve_gives_up_on_an_unreachable_worker(checkpoint):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    result = ktserve("serve", str(checkpoint), "--port", "0", *GPU_FLAGS, "--expert-address",
                     address, "--worker-start-timeout", "1")  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"expert worker {address} was not serving within 1 s" in result.stderr
    assert "last state: unreachable" in result.stderr
