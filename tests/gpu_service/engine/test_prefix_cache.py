"""Prefix caching: the block pool's reference counts and LRU, the KV manager's prefix matching and
its host tier (the tensors' copies between tiers), and the engine's greedy outputs with cache hits
against an engine without them. The caches and the engines live on the `device` fixture's device
(KTSERVE_TEST_DEVICE=cuda on the GPU host: the host tier's copies between GPU and pinned host
memory, CUDA graphs)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import replace

import pytest
import torch
from prometheus_client import generate_latest

from gpu_service.cli import DEMO_MODEL_DIR, serve_config
from gpu_service.config import GPUServiceConfig
from gpu_service.engine import Engine, FinishReason, SamplingParams, SchedulerConfig
from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.kvcache.block_pool import BlockPool, extend_block_hashes
from gpu_service.kvcache.manager import KVCacheManager
from gpu_service.models import KVCacheConfig, KVCacheTensors, TorchExperts, load_model
from ktserve.checkpoint import CheckpointReader
from ktserve.cli import build_parser
from tests.support.checkpoint_fixtures import one_per_family
from tests.support.checkpoints import available_families

BLOCK = 4
FAMILIES = [f for f in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen2_moe", "mixtral")
            if f in available_families()]  # fmt: skip
GREEDY = dict(temperature=0, ignore_eos=True)


CHECKPOINTS = one_per_family(FAMILIES, distinct_seeds=True)


def make_engine(checkpoint, device: torch.device, *, prefix_caching: bool = True,
                cache_tokens: int = 1024, host_tokens: int = 0,
                graphs: DecodeGraphConfig | None = None, **scheduler) -> Engine:  # fmt: skip
    experts = TorchExperts(CheckpointReader(checkpoint), device, torch.float32)
    model = load_model(checkpoint, device, torch.float32, experts=experts,
                       max_num_tokens_in_cache=cache_tokens, block_size=BLOCK)  # fmt: skip
    config = replace(model.kv_cache.config, enable_prefix_caching=prefix_caching,
                     max_num_host_tokens=host_tokens)  # fmt: skip
    model.kv_cache = KVCacheTensors(config, torch.float32, device)
    scheduler_config = SchedulerConfig(**{"max_model_len": 128, **scheduler})
    return Engine(model, scheduler_config, graph_config=graphs).start()


def rand_ids(g: random.Random, n: int) -> list[int]:
    return [g.randrange(101) for _ in range(n)]


def generate(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the prefix cache) of one request."""
    events = engine.generate(prompt, SamplingParams(max_tokens=n, **GREEDY))
    assert events[-1].finish_reason == FinishReason.LENGTH, events[-1].error
    return [t.token_id for e in events for t in e.tokens], events[-1].num_cached_tokens


def test_flags_turn_prefix_caching_off_and_give_it_a_host_tier():
    def gpu(*flags: str) -> GPUServiceConfig:
        return serve_config(build_parser().parse_args(["serve", str(DEMO_MODEL_DIR), *flags])).gpu

    assert gpu().prefix_caching and gpu().kv_host_cache_gib == 0
    assert not gpu("--no-prefix-caching").prefix_caching
    assert gpu("--kv-host-cache-gib", "1.5").kv_host_cache_gib == 1.5
    with pytest.raises(ValueError, match="needs prefix caching"):
        GPUServiceConfig(model_dir="m", prefix_caching=False, kv_host_cache_gib=1.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        GPUServiceConfig(model_dir="m", kv_host_cache_gib=-1.0)


# ------------------------------------------------------------------------- block pool, cache
def test_block_pool_counts_references_and_evicts_least_recently_released():
    pool = BlockPool(4)
    a, _ = pool.take(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    assert not pool.register(a[1], b"other") and not pool.register(3, b"h0")  # one name each
    pool.touch(pool.lookup(b"h0"))  # a second holder of block a[0]
    assert pool.ref_count(a[0]) == 2 and pool.num_free == 2
    pool.release(reversed(a))  # the first holder ends: a[1] cached, a[0] still held
    assert pool.is_evictable(a[1]) and not pool.is_evictable(a[0]) and pool.num_free == 3
    pool.release([a[0]])
    assert pool.num_free == 4 and pool.num_cached == 2
    fresh, evicted = pool.take(2)  # never-cached blocks go first
    assert not evicted and not set(fresh) & set(a)
    pool.release(fresh)
    got, evicted = pool.take(3)
    assert evicted == [(a[1], b"h1")]  # released first (a sequence's tail goes first)
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == a[0]
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])
    pool.reset()
    assert pool.lookup(b"h0") is None and pool.num_free == 1


def test_block_hashes_chain_over_the_whole_prefix():
    one, two, partial = [], [], []
    extend_block_hashes(one, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    extend_block_hashes(two, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    extend_block_hashes(partial, [1, 2, 3, 4, 5], 4)
    assert len(one) == 2 and len(partial) == 1 and partial[0] == one[0]
    assert two[1] != one[1]  # the same tokens after another first block: another prefix
    extend_block_hashes(partial, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert partial == one


def cache_with_data(
    num_tokens: int, device: torch.device, host_tokens: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[KVCacheManager, KVCacheTensors]:
    """One cache's manager and tensors."""
    config = KVCacheConfig(num_layers=2, entry_shapes=((2, 3), (5,)), max_num_tokens=num_tokens,
                           block_size=BLOCK, max_num_host_tokens=host_tokens)  # fmt: skip
    return KVCacheManager(config), KVCacheTensors(config, dtype, device)


def write(tensors: KVCacheTensors, seq, tokens: int, value: float) -> None:
    """Stand-in for a forward: K/V of positions [num_tokens, tokens) = value + position."""
    for pos in range(seq.num_tokens, tokens):
        [slot] = seq.slots(pos, pos + 1)
        for layer in tensors.layers:
            for t in layer:
                t[slot] = value + pos
    seq.num_tokens = tokens


def test_allocation_reuses_the_longest_cached_prefix(device):
    cache, tensors = cache_with_data(40, device)
    ids = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids, BLOCK)
    a = cache.allocate(10, hashes)
    assert a.num_tokens == 0 and cache.stats.queries == 10 and cache.stats.device_hits == 0
    write(tensors, a, 10, 0.0)
    cache.cache_blocks(a, hashes)
    b = cache.allocate(10, hashes)  # shares both full blocks, computes the last 2 tokens
    assert b.num_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert cache.pool.ref_count(a.block_ids[0]) == 2 and cache.num_free_blocks == 10 - 4
    exact: list[bytes] = []
    extend_block_hashes(exact, ids[:8], BLOCK)
    c = cache.allocate(8, exact)  # all 8 cached: the last block is computed again for logits
    assert c.num_tokens == 4
    cache.free(a)
    cache.free(b)
    cache.free(c)
    assert cache.num_free_blocks == 10 and cache.pool.num_cached == 2
    # 1 free block and the 2 cached ones left: a hit on those needs only the free one more
    held = cache.allocate(28)
    assert cache.can_allocate(12, hashes) and cache.can_allocate(12)  # the miss evicts them
    assert not cache.can_allocate(16, hashes)  # 2 hits and 2 more: 1 is free beside the hits
    d = cache.allocate(12, hashes)
    assert d.num_tokens == 8 and cache.num_free_blocks == 0
    cache.free(held)
    cache.free(d)
    off = KVCacheManager(replace(cache.config, enable_prefix_caching=False))
    e = off.allocate(10, hashes)
    write(tensors, e, 10, 0.0)
    off.cache_blocks(e, hashes)
    assert off.allocate(10, hashes).num_tokens == 0 and off.stats.queries == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_evicted_blocks_go_to_host_ram_and_come_back_with_their_contents(device, dtype):
    # 3 device, 4 host blocks
    cache, tensors = cache_with_data(12, device, host_tokens=16, dtype=dtype)
    ids = list(range(9))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids, BLOCK)
    a = cache.allocate(9, hashes)
    write(tensors, a, 9, 100.0)
    cache.cache_blocks(a, hashes)
    want = [t[a.slots(0, 8)].clone() for layer in tensors.layers for t in layer]
    assert all(w.dtype == dtype and w.float().abs().min() >= 96 for w in want)
    cache.free(a)
    assert cache.take_copies() == ()
    other = cache.allocate(12)  # evicts both cached blocks: copies to the host tier
    copies = cache.take_copies()
    assert [c.to_host for c in copies] == [True, True] and cache.host.num_stored == 2
    tensors.copy_blocks(copies)
    write(tensors, other, 12, -1.0)  # the device blocks are overwritten
    cache.free(other)
    b = cache.allocate(9, hashes)  # found in host RAM, brought back into fresh blocks
    assert b.num_tokens == 8 and cache.stats.host_hits == 8 and cache.stats.device_hits == 0
    tensors.copy_blocks(cache.take_copies())
    got = [t[b.slots(0, 8)] for layer in tensors.layers for t in layer]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    cache.free(b)
    c = cache.allocate(9, hashes)  # back on the device now: no copy
    assert c.num_tokens == 8 and cache.stats.device_hits == 8 and cache.take_copies() == ()
    cache.free(c)
    cache.reset_prefix_cache()  # what the engine does when a step with copies fails
    assert cache.allocate(9, hashes).num_tokens == 0 and cache.host.num_stored == 0


# ------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_outputs_with_cache_hits_equal_those_without(family, checkpoints, seed, device):
    """The same requests one after another, with prefix caching (prefills chunked at 5 tokens,
    so hits and chunks mix) and without: identical tokens, and the hits counted where expected:
    the same prompt again (all but its last token), a prompt sharing 10 tokens (the hit ends
    mid-block: 8), an agent turn (prompt + output + more: the decoded blocks too)."""
    g = random.Random(seed)
    a = rand_ids(g, 13)
    cached = make_engine(checkpoints[family], device, max_num_batched_tokens=5)
    plain = make_engine(checkpoints[family], device, prefix_caching=False)
    try:
        first, hit = generate(cached, a, 12)
        assert generate(plain, a, 12)[0] == first and hit == 0
        turn = a + first + rand_ids(g, 6)  # 31 tokens, 24 computed by the first request
        requests = [(a, 12), (a[:10] + rand_ids(g, 5), 12), (turn, 10)]
        hits = []
        for prompt, n in requests:
            tokens, hit = generate(cached, prompt, n)
            hits.append(hit)
            assert tokens == generate(plain, prompt, n)[0], f"{family}: {len(prompt)} tokens"
        metrics, stats = cached.metrics, cached.scheduler.kv_manager.stats
    finally:
        cached.stop()
        plain.stop()
    assert hits == [12, 8, 24]
    assert stats.queries == 13 + 13 + 15 + 31 and stats.device_hits == sum(hits)
    assert metrics.prefix_cache_queries._value.get() == stats.queries
    assert metrics.prefix_cache_hits.labels(tier="gpu")._value.get() == sum(hits)
    assert metrics.prefix_cache_hit_rate["gpu"]._value.get() == sum(hits) / stats.queries
    assert plain.scheduler.kv_manager.stats.queries == 0
    exported = generate_latest(metrics.registry).decode()
    for line in (f"ktserve_prefix_cache_queries_total {float(stats.queries)}",
                 f'ktserve_prefix_cache_hits_total{{tier="gpu"}} {float(sum(hits))}',
                 'ktserve_prefix_cache_hits_total{tier="cpu"} 0.0',
                 "ktserve_cpu_prefix_cache_hit_rate 0.0"):  # fmt: skip
        assert line in exported
    for eng in (cached, plain):
        kv = eng.scheduler.kv_manager
        assert kv.num_free_blocks == kv.config.num_blocks


@pytest.mark.parametrize("family", [f for f in ("deepseek_v3", "qwen3_moe") if f in FAMILIES])
def test_a_prefix_evicted_to_host_ram_is_restored_exactly(family, checkpoints, seed, device):
    """A 10-block device cache: later requests evict the first prompt's blocks (copied to the
    host tier); asked again, its prefix comes back from host RAM, and the tokens equal those of
    an engine without prefix caching."""
    g = random.Random(seed + 1)
    prompts = [rand_ids(g, 14) for _ in range(4)]
    cached = make_engine(checkpoints[family], device, cache_tokens=40, host_tokens=256)
    plain = make_engine(checkpoints[family], device, prefix_caching=False, cache_tokens=40)
    try:
        want = [generate(plain, p, 4)[0] for p in prompts]
        assert [generate(cached, p, 4) for p in prompts] == [(w, 0) for w in want]
        stats = cached.scheduler.kv_manager.stats
        assert stats.host_hits == 0 and cached.scheduler.kv_manager.host.num_stored > 0
        assert generate(cached, prompts[0], 4) == (want[0], 12)
        assert stats.host_hits > 0  # some or all of it from host RAM
        assert generate(cached, prompts[0], 4) == (want[0], 12)  # then from the device
        host_rate = cached.metrics.prefix_cache_hit_rate["cpu"]._value.get()
    finally:
        cached.stop()
        plain.stop()
    assert host_rate == stats.host_hits / stats.queries > 0


def test_stress_shared_prefixes_aborts_and_preemption_never_free_a_used_block(
    checkpoints, seed, device
):
    """Random requests on three shared prefixes, some aborted mid-way, in a cache too small for
    them all (preemption), decode steps through the segmented path (on CUDA captured as CUDA
    graphs): before every step each block
    is held exactly by the live sequences that list it, none of them free or cached; finished
    requests give the tokens an engine without prefix caching gives."""
    g = random.Random(seed + 2)
    print(f"stress seed {seed + 2}")
    bases = [rand_ids(g, g.randrange(5, 15)) for _ in range(3)]
    requests = [(g.choice(bases) + rand_ids(g, g.randrange(3, 9)), g.randrange(6, 14))
                for _ in range(24)]  # fmt: skip
    aborts = {i: g.randrange(1, 4) for i in g.sample(range(len(requests)), 6)}
    graphs = DecodeGraphConfig(max_batch=4, min_kv_bucket=8, capture=device.type == "cuda")
    eng = make_engine(checkpoints["deepseek_v3"], device, cache_tokens=64, host_tokens=32,
                      max_num_seqs=5, max_num_batched_tokens=9,
                      graphs=graphs)  # fmt: skip
    cache, violations, preempted = eng.scheduler.kv_manager, [], []

    def checked(decide):
        """The scheduler's decision (a step, or a decode step chained to the last one), then
        the blocks' books as the step will run on them."""

        def decided(*args):
            step = decide(*args)
            if step is None:
                return step
            preempted.extend(step.preempted)
            live = list(cache._live.values())
            held = Counter(b for s in live for b in s.block_ids)
            for block in range(cache.config.num_blocks):
                if cache.pool.ref_count(block) != held[block]:
                    violations.append(f"block {block}: ref {cache.pool.ref_count(block)}, "
                                      f"held by {held[block]}")  # fmt: skip
                if held[block] and (block in cache.pool._free or cache.pool.is_evictable(block)):
                    violations.append(f"block {block} is free while a sequence holds it")
            return step

        return decided

    eng.scheduler.schedule = checked(eng.scheduler.schedule)
    eng.scheduler.chain = checked(eng.scheduler.chain)
    results: list[list] = [[] for _ in requests]
    done = threading.Semaphore(0)
    try:
        for i, (prompt, n) in enumerate(requests):

            def on_event(event, i=i):
                results[i].append(event)
                if i in aborts and len(results[i]) == aborts[i]:
                    eng.abort(event.request_id)
                if event.finish_reason is not None:
                    done.release()

            eng.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY), on_event)
        for _ in requests:
            assert done.acquire(timeout=300)
    finally:
        eng.stop()
    stats = cache.stats
    print(f"{len(preempted)} preemptions; of {stats.queries} tokens looked up "
          f"{stats.device_hits} found on the device, {stats.host_hits} in host RAM")  # fmt: skip
    assert not violations, violations[:10]
    assert preempted, "the cache was meant to be too small for every request at once"
    assert cache.num_free_blocks == cache.config.num_blocks
    assert cache.stats.device_hits > 0
    plain = make_engine(checkpoints["deepseek_v3"], device, prefix_caching=False)
    try:
        for i, (prompt, n) in enumerate(requests):
            reason = results[i][-1].finish_reason
            tokens = [t.token_id for e in results[i] for t in e.tokens]
            if reason == FinishReason.ABORT:
                assert i in aborts and len(tokens) < n
            else:
                assert reason == FinishReason.LENGTH, results[i][-1].error
                assert tokens == generate(plain, prompt, n)[0], f"request {i}"
    finally:
        plain.stop()


def test_a_failed_step_with_tier_copies_forgets_the_cached_prefixes(checkpoints, seed, device):
    """A step whose copies between tiers may not have run fails its requests and empties the
    prefix cache: nothing later reads a block a failed copy left."""
    g = random.Random(seed + 3)
    prompts = [rand_ids(g, 14) for _ in range(4)]
    eng = make_engine(checkpoints["deepseek_v3"], device, cache_tokens=40, host_tokens=256)
    plain = make_engine(checkpoints["deepseek_v3"], device, prefix_caching=False, cache_tokens=40)
    run = eng.runner.run

    def failing_run(step):
        if step.block_copies:
            raise RuntimeError("copy failed")
        return run(step)

    try:
        for p in prompts:
            generate(eng, p, 4)
        eng.runner.run = failing_run
        events = eng.generate(prompts[0], SamplingParams(max_tokens=4, **GREEDY))
        eng.runner.run = run
        assert events[-1].finish_reason == FinishReason.ERROR
        kv = eng.scheduler.kv_manager
        assert kv.pool.num_cached == 0 and kv.host.num_stored == 0
        assert generate(eng, prompts[0], 4) == (generate(plain, prompts[0], 4)[0], 0)
    finally:
        eng.stop()
        plain.stop()
