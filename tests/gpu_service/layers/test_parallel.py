"""layers/parallel.py: the shares each rank takes, and a 4-rank gloo model (more ranks than
Mixtral's tiny 2 kv heads: each kv head replicated on 2 ranks) against transformers."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from gpu_service.layers.sharding import Shard, TensorParallel, take_shard
from gpu_service.tensor_parallel.leader import check_devices
from tests.support.checkpoints import load_reference_model, make_tiny_checkpoint
from tests.support.tp_rank import TIMEOUT, run_rank


def test_kv_heads_split_or_replicate():
    assert TensorParallel(1, 2).kv_heads(4) == (2, Shard(0, 2, 1))
    # 2 kv heads over 4 ranks: ranks 0, 1 use head 0, ranks 2, 3 head 1
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [
        (1, Shard(0, 2, 0)), (1, Shard(0, 2, 0)), (1, Shard(0, 2, 1)), (1, Shard(0, 2, 1))
    ]  # fmt: skip
    assert TensorParallel(0, 1).kv_heads(3) == (3, None)
    with pytest.raises(ValueError, match="one must divide the other"):
        TensorParallel(0, 4).kv_heads(6)


def test_shards_and_their_errors():
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(take_shard(w, Shard(0, 2, 1), "w"), w[2:])
    assert torch.equal(take_shard(w, Shard(1, 3, 2), "w"), w[:, 4:])
    assert take_shard(w, Shard(1, 3, 0), "w").is_contiguous()
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight: dimension 1"):
        take_shard(w, Shard(1, 4, 0), "layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="does not divide the model's attention heads"):
        TensorParallel(0, 3).local(4, "attention heads")


def test_four_ranks_with_replicated_kv_heads_match_transformers(tmp_path, seed):
    path = make_tiny_checkpoint("mixtral", tmp_path / "mixtral", seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (7, 3)]
    world = 4
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, store.port, str(path), prompts, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=180)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    reference = load_reference_model(path)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0, -1]
        err = float((got[i] - want).abs().max() / want.abs().max())
        print(f"mixtral TP=4 (kv heads replicated): prompt {i} logits relative error {err:.2e}")
        assert err < 1e-3


def test_more_ranks_than_visible_gpus_are_refused():
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"needs cuda:1..cuda:{visible + 2}, but {visible} GPUs"):
        check_devices(visible + 2, torch.device("cuda", 1))
    check_devices(4, torch.device("cpu"))  # gloo ranks on the host's cores: any number
