"""Two `ktserve expert` processes splitting every expert's intermediate dimension, the GPU
service summing their partial outputs: the same model as transformers' forward, and as two
workers splitting the expert ids; a missing slice is refused before serving."""

from __future__ import annotations

import pytest
import torch

from gpu_service.workers.external_workers import ExternalWorkers
from gpu_service.workers.shard_coverage import ExpertCoverageError
from ktserve.checkpoint.spec import ModelSpec
from ktserve.worker_token import TOKEN_ENV, new_token
from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401
from tests.support.parity import BOUNDS, last_logits, prompts, relative_error
from tests.support.worker_services import worker_service

# Intermediate dimensions of two 64-row blocks: they split in two.
SPLITTABLE = {
    "deepseek_v3": {"moe_intermediate_size": 128},
    "qwen3_moe": {"moe_intermediate_size": 128},
    "mixtral": {"intermediate_size": 128},
}
TOKEN = {TOKEN_ENV: new_token()}  # one token for the workers of one service


def workers(path, *shards: tuple[str, ...]) -> list[ExpertProcess]:
    started = []
    try:
        for flags in shards:
            started.append(ExpertProcess("--model", str(path), "--format", "bf16", *flags,
                                         env=TOKEN))  # fmt: skip
    except BaseException:
        for worker in started:
            worker.close()
        raise
    return started


def logits_on(path, procs: list[ExpertProcess], batch: list[list[int]]) -> torch.Tensor:
    service = worker_service(path, *procs, dtype="float32", kv_cache_tokens=1024)
    try:
        return last_logits(service, batch).cpu()
    finally:
        service.close()


@pytest.mark.parametrize("family", sorted(SPLITTABLE))
def test_intermediate_split_matches_transformers_and_the_expert_split(family, tmp_path, seed):
    path = make_tiny_checkpoint(family, tmp_path / family, seed=seed, **SPLITTABLE[family])
    spec = ModelSpec.from_checkpoint(path)
    half = spec.num_experts // 2
    reference = load_reference_model(path)
    batch = prompts(seed, lengths=(5, 9))
    procs = workers(path, ("--intermediate-rows", "0-63"), ("--intermediate-rows", "64-127"))
    external = ExternalWorkers(tuple(p.address for p in procs), spec, TOKEN[TOKEN_ENV])
    try:
        external.start(60)  # the coverage check passes: every row of every expert, once
        by_rows = logits_on(path, procs, batch)
    finally:
        external.stop()
        for proc in procs:
            proc.close()
    procs = workers(path, ("--experts", f"0-{half - 1}"),
                    ("--experts", f"{half}-{spec.num_experts - 1}"))  # fmt: skip
    try:
        by_ids = logits_on(path, procs, batch)
    finally:
        for proc in procs:
            proc.close()
    for i, prompt in enumerate(batch):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0, -1]
        err, between = relative_error(by_rows[i], want), relative_error(by_rows[i], by_ids[i])
        print(f"{family}: prompt {i}: intermediate split vs transformers {err:.2e}, vs the "
              f"expert-id split {between:.2e}")  # fmt: skip
        assert err < BOUNDS[("float32", "bf16")]
        assert between < 1e-4


def test_a_missing_slice_is_refused(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, seed=seed, **SPLITTABLE["qwen3_moe"])
    spec = ModelSpec.from_checkpoint(path)
    [proc] = workers(path, ("--intermediate-rows", "0-63"))
    external = ExternalWorkers((proc.address,), spec, TOKEN[TOKEN_ENV])
    try:
        with pytest.raises(ExpertCoverageError) as refused:
            external.start(60)
    finally:
        external.stop()
        proc.close()
    message = str(refused.value)
    assert (
        f"no worker holds intermediate rows 64-127 (of 0-127) of experts 0-{spec.num_experts - 1}"
        in message
    )
    assert f"{proc.address} holds 0-{spec.num_experts - 1} rows 0-63" in message
