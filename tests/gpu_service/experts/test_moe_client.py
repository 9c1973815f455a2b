"""The GPU side's expert client against a real worker: a channel whose shared memory was
overwritten (a slot held though nothing is in flight) is replaced, not left wedged."""

from __future__ import annotations

import ctypes

import torch

from gpu_service.config import ExpertClientConfig
from gpu_service.experts.moe_client import ShmExperts
from gpu_service.models import TorchExperts
from ktserve.checkpoint import CheckpointReader
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess

HEADER_BYTES, SLOT_HEADER_BYTES = 4096, 512  # ktshm.h
REPLY = 3


def test_a_corrupt_channel_is_replaced_and_calls_go_on(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed)
    reader = CheckpointReader(path)
    spec = reader.spec
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    experts = ShmExperts(
        ExpertClientConfig((worker.address,), token=worker.token,
                           wire_dtype="float32", worker_timeout_s=20),
        hidden_size=spec.hidden_size, top_k=spec.num_experts_per_tok, max_tokens=16,
    )  # fmt: skip
    try:
        oracle = TorchExperts(reader, "cpu", torch.float32)
        g = torch.Generator().manual_seed(seed)
        layer = spec.moe_layers[0]
        x = torch.randn(5, spec.hidden_size, generator=g)
        ids = torch.randint(0, spec.num_experts, (5, spec.num_experts_per_tok), generator=g,
                            dtype=torch.int32)  # fmt: skip
        weights = torch.rand(5, spec.num_experts_per_tok, generator=g)
        want = oracle.submit(layer, x, ids, weights).wait()
        torch.testing.assert_close(experts.submit(layer, x, ids, weights).wait(), want)
        channel = experts.workers[0].channel
        stride = SLOT_HEADER_BYTES + 2 * channel.region_bytes
        for slot in range(channel.num_slots):  # every slot "holds" a reply nobody asked for
            word = ctypes.c_uint64.from_address(channel.address + HEADER_BYTES + slot * stride)
            word.value = (0xDEAD << 32) | REPLY
        got = experts.submit(layer, x, ids, weights).wait()
        torch.testing.assert_close(got, want)
        assert experts.workers[0].channel is not channel, "the corrupt channel was kept"
        assert experts.alive() == {worker.address: True}
        torch.testing.assert_close(experts.submit(layer, x, ids, weights).wait(), want)
    finally:
        experts.close()
        worker.close()


PRODUCER = """
import sys, torch
from gpu_service.config import ExpertClientConfig
from gpu_service.experts.moe_client import ShmExperts
address, hidden, top_k, num_experts, layer, seed = sys.argv[1:7]
hidden, top_k, num_experts, layer = int(hidden), int(top_k), int(num_experts), int(layer)
token = sys.stdin.readline().strip()  # the worker's, never on the command line
experts = ShmExperts(ExpertClientConfig((address,), token=token, wire_dtype="float32",
                                        worker_timeout_s=20),
                     hidden_size=hidden, top_k=top_k, max_tokens=16)
g = torch.Generator().manual_seed(int(seed))
x = torch.randn(3, hidden, generator=g)
ids = torch.randint(0, num_experts, (3, top_k), generator=g, dtype=torch.int32)
weights = torch.rand(3, top_k, generator=g)
try:
    for line in sys.stdin:
        y = experts.submit(layer, x, ids, weights).wait()
        print(" ".join(f"{v:.6e}" for v in y.flatten()[:8].tolist()), flush=True)
finally:
    experts.close()
"""


def test_a_gpu_service_starved_past_the_peer_timeout_is_served_on(tmp_path, seed):
    """A GPU service whose process is not scheduled for longer than ktshm's peer timeout
    (SIGSTOP here; a loaded machine does it too) is alive: the worker serves its channel again
    once its heartbeat resumes, instead of unlinking it (which left the service with 503s)."""
    import signal
    import subprocess
    import sys
    import time

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed)
    spec = CheckpointReader(path).spec
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    args = [worker.address, spec.hidden_size, spec.num_experts_per_tok, spec.num_experts,
            spec.moe_layers[0], seed]  # fmt: skip
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, *map(str, args)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)  # fmt: skip
    try:
        producer.stdin.write(f"{worker.token}\ncall\n")
        producer.stdin.flush()
        first = producer.stdout.readline()
        assert first.strip(), "the producer made no call"
        producer.send_signal(signal.SIGSTOP)
        time.sleep(3 * 0.5)  # the stall itself: three ktshm peer timeouts (ChannelConfig)
        producer.send_signal(signal.SIGCONT)
        producer.stdin.write("call\n")
        producer.stdin.flush()
        assert producer.stdout.readline() == first, "the call after the stall failed"
        log = worker.stderr()
        assert "came back; serving it on" in log, log[-2000:]
        assert "unlinked" not in log, log[-2000:]
    finally:
        producer.stdin.close()
        producer.wait(60)
        worker.close()
