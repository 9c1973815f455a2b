"""`ktserve expert` as a subprocess: MoE calls over ktshm against transformers' own experts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import ktshm
from ktserve import wire
from ktserve.checkpoint import ModelSpec
from ktserve.protocol import expert_pb2 as pb
from ktserve.protocol import expert_pb2_grpc as pb_grpc
from ktserve.worker_auth import worker_channel
from ktserve.worker_token import TOKEN_ENV, TOKEN_FILE_ENV, new_token
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.checkpoints import load_reference_model, moe_block
from tests.support.expert_procs import (  # noqa: F401 - no_segments_left_behind is an autouse fixture
    FORMAT_PB,
    ExpertProcess,
    moe_call,
    no_segments_left_behind,
    shm_entries,
)
from tests.support.watched_process import CHILD_ENV, REPO

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "glm4_moe")
# Normalized error ||y - ref|| / ||ref|| against transformers' fp32 experts (the kernel's own
# bounds, see tests/expert_service/test_kernels.py). bf16 weights with fp32 x on the wire: exact
# fp32 math (the checkpoint is bf16), only the summation order differs; int8 has a per-row step
# of max|w|/127 (~0.2% rms per weight); int4 a per-32-group step of max|w|/7 (~9% rms; with
# a token or three, few experts average it out: the kernel's tests allow 36% there).
TOLERANCE = {"bf16": 1e-5, "int8": 5e-2, "int4": 0.36}


CHECKPOINTS = one_per_family(FAMILIES)


@pytest.fixture(scope="module")
def references(checkpoints):
    return {f: load_reference_model(p) for f, p in checkpoints.items()}


@pytest.fixture
def procs():
    started: list[ExpertProcess] = []

    def start(*args: str, **kwargs) -> ExpertProcess:
        p = ExpertProcess(*args, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def channel():
    ch = ktshm.Channel.create(ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16))
    yield ch
    ch.close()


def routing(spec: ModelSpec, num_tokens: int, rng: np.random.Generator):
    """Distinct experts per token (as a router picks them), softmax-like weights."""
    k = spec.num_experts_per_tok
    ids = np.stack([rng.permutation(spec.num_experts)[:k] for _ in range(num_tokens)])
    weights = rng.random((num_tokens, k)).astype(np.float32)
    return ids.astype(np.int32), weights / weights.sum(1, keepdims=True)


def reference(model, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
    with torch.no_grad():
        y = moe_block(model, layer).experts(
            torch.from_numpy(x), torch.from_numpy(ids).long(), torch.from_numpy(weights)
        )
    return y.numpy()


def stats_after_calls(worker: ExpertProcess, calls: int) -> pb.WorkerStats:
    """GetStats right after the replies: it must already count every call whose reply we read
    (the worker counts a call just after publishing its reply, and GetStats waits for that)."""
    stats = worker.stub.GetStats(pb.StatsRequest(), timeout=10)
    assert stats.calls == calls
    phases = (stats.dispatch_seconds, stats.kernel_seconds, stats.publish_seconds)
    assert all(p >= 0 for p in phases) and (calls == 0 or stats.kernel_seconds > 0)
    # busy_seconds runs from taking a request to publishing its reply: the three phases
    assert sum(phases) == pytest.approx(stats.busy_seconds, rel=1e-6, abs=1e-9)
    return stats


def normalized_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_replies_match_transformers_experts(family, fmt, checkpoints, references, procs, channel,
                                            seed):  # fmt: skip
    spec = ModelSpec.from_checkpoint(checkpoints[family])
    worker = procs("--model", str(checkpoints[family]), "--format", fmt)
    worker.attach(channel)
    rng = np.random.default_rng(seed)
    for num_tokens in (1, 3, 17):
        for layer in spec.moe_layers:
            x = rng.standard_normal((num_tokens, spec.hidden_size)).astype(np.float32)
            ids, weights = routing(spec, num_tokens, rng)
            got = moe_call(channel, layer, x, ids, weights)
            err = normalized_error(got, reference(references[family], layer, x, ids, weights))
            print(f"{family} {fmt} T={num_tokens} layer={layer}: normalized error {err:.2e}")
            assert err < TOLERANCE[fmt]


def test_complementary_shards_sum_to_the_whole(checkpoints, references, procs, seed):
    family = "deepseek_v3"
    spec = ModelSpec.from_checkpoint(checkpoints[family])
    half = spec.num_experts // 2
    low = procs(
        "--model", str(checkpoints[family]), "--format", "bf16", "--experts", f"0-{half - 1}"
    )
    high = procs("--model", str(checkpoints[family]), "--format", "bf16",
                 "--experts", f"{half}-{spec.num_experts - 1}")  # fmt: skip
    config = ktshm.ChannelConfig(num_slots=4, region_bytes=1 << 16)
    rng = np.random.default_rng(seed)
    with ktshm.Channel.create(config) as ch_low, ktshm.Channel.create(config) as ch_high:
        low.attach(ch_low)
        high.attach(ch_high)
        x = rng.standard_normal((9, spec.hidden_size)).astype(np.float32)
        ids, weights = routing(spec, 9, rng)
        layer = spec.moe_layers[-1]
        y_low = moe_call(ch_low, layer, x, ids, weights)
        y_high = moe_call(ch_high, layer, x, ids, weights)
        want = reference(references[family], layer, x, ids, weights)
        assert normalized_error(y_low + y_high, want) < TOLERANCE["bf16"]
        assert normalized_error(y_low, want) > 1e-2  # each half alone is not the answer


def test_killed_worker_is_replaced_on_the_same_channel(checkpoints, references, procs, channel,
                                                       seed):  # fmt: skip
    """The worker is stopped (SIGSTOP, every thread seen stopped) before the call is sent, then
    killed: it provably never answers. A new worker attaches, the producer's wait says
    PeerRestarted, resend_inflight re-stamps the call, and the new worker runs it."""
    family = "qwen3_moe"
    spec = ModelSpec.from_checkpoint(checkpoints[family])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, spec.hidden_size)).astype(np.float32)
    ids, weights = routing(spec, 4, rng)
    layer = spec.moe_layers[0]
    want = reference(references[family], layer, x, ids, weights)

    first = procs("--model", str(checkpoints[family]), "--format", "bf16")
    first_epoch = first.attach(channel)
    assert normalized_error(moe_call(channel, layer, x, ids, weights), want) < TOLERANCE["bf16"]
    pid = first.proc.pid

    def thread_states() -> list[str]:
        """The state letter of each of the worker's threads (/proc/PID/task/TID/stat)."""
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except FileNotFoundError:  # the thread exited meanwhile
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        return states

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not all(state in "tT" for state in thread_states()):
        assert time.monotonic() < deadline, f"pid {pid} not stopped: {thread_states()}"
        time.sleep(0.001)
    seq = channel.send(wire.KIND_MOE, layer, [x, ids, weights], num_tokens=4)
    first.kill()
    assert first.proc.returncode == -signal.SIGKILL
    # NOTE: a wait checks the reply word again before it reports a dead peer: no reply landed.
    with pytest.raises(ktshm.PeerDied):
        channel.recv(seq, timeout=10)

    second = procs("--model", str(checkpoints[family]), "--format", "bf16")
    second_epoch = second.attach(channel)
    assert second_epoch != first_epoch
    with pytest.raises(ktshm.PeerRestarted):
        channel.recv(seq, timeout=10)
    stats_after_calls(second, 0)  # the call is stamped with the dead worker's epoch
    assert channel.resend_inflight() == [seq]
    assert channel.epoch == second_epoch
    reply = channel.recv(seq, timeout=10)
    assert normalized_error(reply.arrays[0], want) < TOLERANCE["bf16"]
    channel.release(seq)
    stats_after_calls(second, 1)  # the resent call is the new worker's first
    assert normalized_error(moe_call(channel, layer, x, ids, weights), want) < TOLERANCE["bf16"]
    stats_after_calls(second, 2)


def test_bad_calls_get_error_replies_and_the_worker_keeps_serving(checkpoints, procs, channel):
    spec = ModelSpec.from_checkpoint(checkpoints["mixtral"])
    worker = procs("--model", str(checkpoints["mixtral"]), "--format", "int8")
    worker.attach(channel)
    H, k = spec.hidden_size, spec.num_experts_per_tok
    x = np.ones((2, H), np.float32)
    ids = np.zeros((2, k), np.int32)
    w = np.ones((2, k), np.float32)
    cases = [
        (wire.KIND_MOE, 99, [x, ids, w], "layer 99 has no routed experts"),
        (wire.KIND_MOE, 0, [x[:, :-1], ids, w], f"x must be \\[T, {H}\\]"),
        (wire.KIND_MOE, 0, [x, ids.astype(np.int64), w], "ids must be"),
        (wire.KIND_MOE, 0, [x, ids, w[:, :1]], "weights must be"),
        (wire.KIND_MOE, 0, [x, ids + spec.num_experts, w], "expert ids must be in"),
        (wire.KIND_MOE, 0, [x, ids], "carries 3 arrays"),
        (77, 0, [x, ids, w], "unknown message kind 77"),
    ]
    for kind, layer, arrays, message in cases:
        with pytest.raises(ktshm.RemoteError, match=message):
            channel.call(kind, layer, arrays, timeout=10)
    y = moe_call(channel, 0, x, ids, w)
    assert y.shape == (2, H) and np.isfinite(y).all()
    stats = stats_after_calls(worker, 1)
    assert stats.errors == len(cases)


def test_info_stats_health_and_metrics(checkpoints, procs, channel):
    path = checkpoints["deepseek_v3"]
    spec = ModelSpec.from_checkpoint(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    worker = procs("--model", str(path), "--format", "int4", "--experts", "2-9",
                   "--metrics-port", str(metrics_port))  # fmt: skip
    info = worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert info.state == pb.WORKER_STATE_SERVING and info.format == pb.WEIGHT_FORMAT_INT4
    assert (info.experts.start, info.experts.stop) == (2, 10)
    assert list(info.moe_layers) == list(spec.moe_layers) and info.isa and info.weight_bytes > 0
    health = health_pb2_grpc.HealthStub(worker.grpc_channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING

    worker.attach(channel)
    assert channel.name in worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).channels
    ids = np.array([[2, 3, 11], [2, 0, 1]], np.int32)  # 11, 0 and 1 are not held: skipped
    x = np.ones((2, spec.hidden_size), np.float32)
    moe_call(channel, spec.moe_layers[0], x, ids, np.ones((2, 3), np.float32))
    stats = stats_after_calls(worker, 1)
    assert stats.tokens == 2
    assert not stats.HasField("call_timings")  # kept only with --call-timing-samples
    counts = {(a.layer, a.expert): a.count for a in stats.activations}
    assert counts == {(spec.moe_layers[0], 2): 2, (spec.moe_layers[0], 3): 1}
    assert stats.weight_bytes_read == 2 * info.weight_bytes // (8 * len(spec.moe_layers))

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    samples, names = {}, set()  # every sample carries model_name: by default the model's dir name
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            names.add(s.labels.get("model_name"))
            rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{rest}}}"] = s.value
    assert names == {path.resolve().name}
    layer = spec.moe_layers[0]
    assert samples[f"ktserve_expert_moe_call_seconds_count{{layer={layer}}}"] == 1
    assert samples["ktserve_expert_tokens_total{}"] == 2
    assert samples[f"ktserve_expert_activations_total{{expert=2,layer={layer}}}"] == 2
    assert samples["ktserve_expert_weight_bytes_read_total{}"] == stats.weight_bytes_read
    assert any(k.startswith("ktserve_expert_kernel_info{isa=") for k in samples)


def test_convert_then_load_gives_identical_replies(checkpoints, procs, channel, tmp_path, seed):
    path = checkpoints["qwen3_moe"]
    spec = ModelSpec.from_checkpoint(path)
    out = tmp_path / "packed"
    result = subprocess.run(
        [sys.executable, "-m", "ktserve", "convert", "--model", str(path),
         "--out", str(out), "--format", "int4", "--experts", "0-5", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, env=CHILD_ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "layers" in result.stderr  # progress bar on stderr
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, spec.hidden_size)).astype(np.float32)
    ids, weights = routing(spec, 5, rng)
    layer = spec.moe_layers[-1]
    direct = procs("--model", str(path), "--format", "int4", "--experts", "0-5")
    direct.attach(channel)
    y_direct = moe_call(channel, layer, x, ids, weights)
    direct.stub.Detach(pb.DetachRequest(channel_name=channel.name), timeout=10)
    mapped = procs("--model", str(out), "--format", "int4", "--experts", "0-5")
    mapped.attach(channel)
    np.testing.assert_array_equal(moe_call(channel, layer, x, ids, weights), y_direct)
    # a converted directory serves only what it holds
    bad = subprocess.run(
        [sys.executable, "-m", "ktserve", "expert", "--model", str(out),
         "--format", "int8", "--listen", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, env={**CHILD_ENV, TOKEN_ENV: new_token()},
        timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "holds experts 0-5 in int4" in bad.stderr


def test_sigterm_drains_then_exits(checkpoints, procs, channel):
    worker = procs("--model", str(checkpoints["mixtral"]), "--format", "bf16")
    worker.attach(channel)
    spec = ModelSpec.from_checkpoint(checkpoints["mixtral"])
    x = np.ones((3, spec.hidden_size), np.float32)
    ids, w = np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32)
    seqs = [channel.send(wire.KIND_MOE, 0, [x, ids, w], num_tokens=3) for _ in range(3)]
    assert worker.terminate() == 0
    for seq in seqs:  # queued before SIGTERM: every one answered
        assert channel.recv(seq, timeout=10).arrays[0].shape == (3, spec.hidden_size)
        channel.release(seq)
    worker.read_line("drained after 3 calls")


# ------------------------------------------------------------------------------ errors
@pytest.fixture(scope="module")
def empty_worker():
    worker = ExpertProcess()
    yield worker
    worker.close()


def load(worker: ExpertProcess, path, fmt="int8", experts=None):
    request = pb.LoadModelRequest(model_dir=str(path), format=FORMAT_PB[fmt])
    if experts is not None:
        request.experts.start, request.experts.stop = experts
    return list(worker.stub.LoadModel(request, timeout=120))


def write_config(path: Path, **config) -> Path:
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "case, code, message",
    [
        ("missing", grpc.StatusCode.NOT_FOUND, "does not exist"),
        ("no_safetensors", grpc.StatusCode.INVALID_ARGUMENT, "safetensors"),
        ("not_moe", grpc.StatusCode.INVALID_ARGUMENT, "not a Mixture-of-Experts"),
        ("unknown_arch", grpc.StatusCode.INVALID_ARGUMENT, "supported"),
        ("bad_shape", grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        ("bad_shard", grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    ],
)
def test_load_errors(case, code, message, empty_worker, checkpoints, tmp_path):
    good = checkpoints["mixtral"]
    experts = None
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "no_safetensors":
        path = write_config(
            tmp_path / "c", **__import__("json").loads((good / "config.json").read_text())
        )
    elif case == "not_moe":
        path = write_config(tmp_path / "c", model_type="llama", hidden_size=8, num_hidden_layers=1)
    elif case == "unknown_arch":
        path = write_config(tmp_path / "c", model_type="grok_moe", num_experts=4)
    elif case == "bad_shape":
        import json
        import shutil

        path = tmp_path / "c"
        shutil.copytree(good, path)
        config = json.loads((path / "config.json").read_text())
        config["hidden_size"] += 8
        (path / "config.json").write_text(json.dumps(config))
    else:
        path, experts = good, (4, 99)
    with pytest.raises(grpc.RpcError) as info:
        load(empty_worker, path, experts=experts)
    assert info.value.code() == code, info.value.details()
    assert message.lower() in info.value.details().lower()
    state = empty_worker.stub.GetInfo(pb.GetInfoRequest(), timeout=10).state
    assert state == pb.WORKER_STATE_EMPTY  # a failed load leaves the worker usable


def test_not_enough_memory_is_checked_before_loading(checkpoints, procs):
    worker = procs(env={"KTSERVE_MEMORY_LIMIT_BYTES": "1000"})
    with pytest.raises(grpc.RpcError) as info:
        load(worker, checkpoints["deepseek_v3"])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "GiB" in info.value.details()


def test_second_load_while_serving_and_missing_channel(checkpoints, procs):
    worker = procs()
    updates = load(worker, checkpoints["qwen3_moe"], fmt="bf16")
    assert updates[-1].done and updates[-1].info.state == pb.WORKER_STATE_SERVING
    assert updates[0].layers_total == len(
        ModelSpec.from_checkpoint(checkpoints["qwen3_moe"]).moe_layers
    )
    with pytest.raises(grpc.RpcError) as info:
        load(worker, checkpoints["mixtral"])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already serving" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Attach(pb.AttachRequest(channel_name="ktshm.1.0000000000000000"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_cli_reports_errors_clearly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ktserve", "expert", "--model", str(tmp_path / "none"),
         "--listen", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, env={**CHILD_ENV, TOKEN_ENV: new_token()},
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "error:" in result.stderr and "does not exist" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "ktserve", "expert", "--experts", "9-3"],
        cwd=REPO, capture_output=True, text=True, env=CHILD_ENV,
    )  # fmt: skip
    assert result.returncode == 2 and "comes before" in result.stderr


# ------------------------------------------------------------------------ control plane
def test_worker_takes_calls_only_with_its_token(checkpoints, procs, channel):
    """With a token (from the environment, never a flag) every RPC but health needs it: GetInfo,
    Attach and Drain without it are UNAUTHENTICATED, and nothing happened; with it they work."""
    token = "t0k3n-" + os.urandom(8).hex()
    worker = procs("--model", str(checkpoints["mixtral"]), "--format", "bf16",
                   env={TOKEN_ENV: token})  # fmt: skip
    assert token not in " ".join(worker.proc.args)
    calls = [
        lambda stub: stub.GetInfo(pb.GetInfoRequest(), timeout=10),
        lambda stub: stub.Attach(pb.AttachRequest(channel_name=channel.name), timeout=10),
        lambda stub: stub.Drain(pb.DrainRequest(exit=True), timeout=10),
    ]
    for sent in (None, "not-" + token):
        anyone = worker_channel(worker.address, sent)
        try:
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call(pb_grpc.ExpertServiceStub(anyone))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, sent
            health = health_pb2_grpc.HealthStub(anyone).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open: liveness
        finally:
            anyone.close()
    assert worker.proc.poll() is None and not channel.peer_alive()  # no Drain, no Attach
    right = worker_channel(worker.address, token)
    try:
        stub = pb_grpc.ExpertServiceStub(right)
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).state == pb.WORKER_STATE_SERVING
        stub.Attach(pb.AttachRequest(channel_name=channel.name), timeout=10)
        channel.wait_for_peer(timeout=10)
    finally:
        right.close()


def expert_without_token(listen: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in CHILD_ENV.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    return subprocess.run([sys.executable, "-m", "ktserve", "expert", "--listen", listen],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
def test_a_worker_on_loopback_needs_a_token(listen):
    """Every local user can connect to a loopback port: no token, no worker (exit 2, saying how
    to give it one), and nothing listens meanwhile."""
    done = expert_without_token(listen)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "listening on" not in done.stdout
    assert TOKEN_FILE_ENV in done.stderr and "--worker-token-file" in done.stderr


def test_a_worker_without_token_listens_only_on_a_private_unix_socket(tmp_path, procs):
    """Without a token a Unix socket must sit in a directory only this user can enter; in a
    private one the worker serves (GetInfo with no token) and the socket is gone after it."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    done = expert_without_token(f"unix:{shared}/w.sock")
    assert done.returncode == 2 and "other users can enter" in done.stderr, done.stderr
    assert not (shared / "w.sock").exists()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    env = {TOKEN_ENV: "", TOKEN_FILE_ENV: ""}  # NOTE: empty is unset (read_token's `or`)
    worker = procs("--listen", f"unix:{private}/w.sock", env=env)
    assert worker.address == f"unix:{private}/w.sock"
    channel = grpc.insecure_channel(worker.address)
    try:
        info = pb_grpc.ExpertServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.state == pb.WORKER_STATE_EMPTY
    finally:
        channel.close()


def test_a_worker_reachable_from_other_machines_needs_a_token():
    done = subprocess.run([sys.executable, "-m", "ktserve", "expert", "--listen", "0.0.0.0:0"],
                          env=CHILD_ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "token" in done.stderr and TOKEN_FILE_ENV in done.stderr


def test_both_token_file_flags_share_their_lookup_and_help(monkeypatch, tmp_path):
    """`ktserve expert --token-file` and `ktserve serve --worker-token-file` are one builder's
    (ktserve/worker_token.py): the same variable fills both, and both explain it alike."""
    from expert_service.config import WorkerConfig
    from gpu_service.cli import serve_config
    from gpu_service.config import DEMO_MODEL_DIR
    from ktserve.cli import build_parser
    from ktserve.config_flags import from_args

    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    parser = build_parser()
    worker = from_args(WorkerConfig, parser.parse_args(["expert"]))
    serve = serve_config(parser.parse_args(["serve", str(DEMO_MODEL_DIR)]))
    assert worker.token_file == serve.workers.worker_token_file == str(tmp_path / "token")
    shared = f"without either, the token in {TOKEN_ENV}). "
    helps = [
        " ".join(sub.format_help().split())
        for name, sub in parser._subparsers._group_actions[0].choices.items()
        if name in ("expert", "serve")
    ]
    assert len(helps) == 2 and all(shared in h for h in helps)
    assert all("The token is never a flag" in h for h in helps)
