"""The scheduler's mixed steps, without a model: a real paged KV cache, a forward simulated by
advancing each sequence's cache, and step times from known laws fed to its cost models (one for
steps through the CPU workers, one for steps that stream). Chunk sizes are checked against those
laws by brute force over every size (the costs per token of the chunk chosen against the least
of any, the step against a stall target), and every prompt's tokens against what it must feed:
each once, in order."""

from __future__ import annotations

import random

import pytest

from gpu_service.config import SchedulerConfig
from gpu_service.engine.chunk_policy import EFFICIENCY_SLACK, GRID_STEP, StepCostModels
from gpu_service.engine.request import FinishReason, Request, RequestState
from gpu_service.engine.sampling import SampledToken, SamplingParams
from gpu_service.engine.scheduler import Scheduler
from gpu_service.engine.step_cost import StepCostFit, StepCostModel, StepShape
from gpu_service.kvcache.config import KVCacheConfig

LAW = StepCostFit(fixed_s=0.05, per_token_s=0.002, per_pair_s=2e-7)
# a streamed step: the layers' copies (fixed), then little per token
STREAM_LAW = StepCostFit(fixed_s=0.3, per_token_s=0.0002, per_pair_s=2e-7)
BLOCK = 4
FLOOR = SchedulerConfig().min_prefill_chunk_tokens


def make_scheduler(cache_tokens: int = 8192, prefix_caching: bool = False,
                   **config) -> Scheduler:  # fmt: skip
    kv = KVCacheConfig(num_layers=1, entry_shapes=((1,),), max_num_tokens=cache_tokens,
                       block_size=BLOCK, enable_prefix_caching=prefix_caching)  # fmt: skip
    return Scheduler(SchedulerConfig(**{"max_model_len": 4096, **config}), kv)


def teach(model: StepCostModel, g: random.Random, law: StepCostFit = LAW, n: int = 24) -> None:
    """Steps of decode rows, most with a prompt chunk, timed by law."""
    for _ in range(n):
        shape = StepShape()
        for _ in range(g.randrange(1, 9)):
            shape = shape.plus_seq(g.randrange(1, 300), 1)
        if g.random() < 0.6 or law is not LAW:
            shape = shape.plus_seq(g.randrange(0, 2000), g.randrange(2, 400))
        model.observe(shape, law.seconds(shape))


class Simulation:
    """Runs steps as the engine would, with the model's forward replaced by its bookkeeping: a
    sequence's cache holds what the step fed, a sampling row appends the next token."""

    def __init__(self, scheduler: Scheduler, g: random.Random) -> None:
        self.scheduler, self.g = scheduler, g
        self.fed: dict[str, list[int]] = {}  # token ids each request fed, in order
        self.steps = []

    def add(self, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> Request:
        prompt = prompt or [self.g.randrange(1, 1000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = Request(f"r{len(self.fed)}", prompt, params)
        self.fed[request.request_id] = []
        self.scheduler.add(request)
        return request

    def step(self):
        step = self.scheduler.schedule()
        self.steps.append(step)
        for request in step.preempted:
            self.fed[request.request_id] = []  # recomputed from its prompt and output
        for s in step.seqs:
            request = s.request
            if request.state != RequestState.RUNNING:
                continue
            if not self.fed[request.request_id]:  # admitted after a cached prefix (or none)
                self.fed[request.request_id] = request.all_ids[: s.start_pos]
            assert s.start_pos == len(self.fed[request.request_id])
            self.fed[request.request_id].extend(s.token_ids)
            request.cache.num_tokens = s.start_pos + len(s.token_ids)
            if s.samples:
                request.add_output(SampledToken(self.g.randrange(1, 1000)))
                if len(request.output) == request.params.max_tokens:
                    self.scheduler.finish(request, FinishReason.LENGTH, None)
        if step.seqs:
            models = self.scheduler.cost_models
            prefill = sum(len(s.token_ids) for s in step.seqs if len(s.token_ids) > 1)
            streamed = models.streams(prefill)
            law = STREAM_LAW if streamed else LAW
            model = models.streamed if streamed else models.cpu
            model.observe(StepShape.of(step.seqs), law.seconds(StepShape.of(step.seqs)))
        return step

    def run_until_done(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps")


def decode_rows(step) -> list:
    return [s for s in step.seqs if len(s.token_ids) == 1 and not s.request.finished]


def largest_chunk(base: StepShape, start: int, bound: float, limit: int,
                  law: StepCostFit = LAW) -> int:  # fmt: skip
    """The oracle: the largest chunk whose step law times within bound."""
    return max(k for k in range(limit + 1) if law.seconds(base.plus_seq(start, k)) <= bound)


def costs(decodes: StepShape, n: int, decode_s: float, law: StepCostFit) -> tuple[float, float]:
    """A chunk of n beside decode rows, by law: (the step's time per prompt token, its time over
    the decodes' own per prompt token), the chunk's attention left out."""
    step_s = max(law.seconds(StepShape(decodes.num_tokens + n, decodes.num_attention_pairs)),
                 decode_s)  # fmt: skip
    return step_s / n, (step_s - decode_s) / n


def efficient_sizes(decodes: StepShape, wanted: int, decode_s: float, sizes: range,
                    law: StepCostFit = LAW) -> list[int]:  # fmt: skip
    """The oracle: the chunk sizes (of `sizes`) whose two costs per token are within the slack
    of the least over every size up to wanted."""
    every = [costs(decodes, n, decode_s, law) for n in range(1, wanted + 1)]
    least_l, least_c = min(c[0] for c in every), min(c[1] for c in every)
    slack = 1 + EFFICIENCY_SLACK + 1e-9
    return [n for n in sizes
            if costs(decodes, n, decode_s, law)[0] <= least_l * slack
            and costs(decodes, n, decode_s, law)[1] <= least_c * slack]  # fmt: skip


def start_decodes(sim: Simulation, num: int, max_tokens: int = 10_000) -> list[Request]:
    decodes = [sim.add(sim.g.randrange(3, 30), max_tokens) for _ in range(num)]
    while any(not r.output for r in decodes):
        sim.step()
    return decodes


def prompt_steps(sim: Simulation, prompt: Request):
    """The steps until the prompt samples, each with the prompt's chunk and the shape of the
    step's other rows."""
    while not prompt.output:
        step = sim.step()
        [chunk] = [s for s in step.seqs if s.request is prompt]
        yield step, chunk, StepShape.of(s for s in step.seqs if s.request is not prompt)


def check_efficient(chunk_len: int, decodes: StepShape, wanted: int, decode_s: float,
                    law: StepCostFit = LAW, least: int = 1) -> None:  # fmt: skip
    """The chunk's costs per token are within the slack of the least, and no size below it by
    more than the policy's grid step would do as well (sizes below `least` not allowed)."""
    assert chunk_len in efficient_sizes(decodes, wanted, decode_s, range(chunk_len, chunk_len + 1),
                                        law)  # fmt: skip
    smaller = efficient_sizes(decodes, wanted, decode_s, range(least, chunk_len), law)
    assert not smaller or chunk_len <= min(smaller) * GRID_STEP + 1, (chunk_len, min(smaller))


def test_a_prompt_beside_decodes_gets_the_smallest_chunk_that_costs_as_little(seed):
    """Eager decode steps (as on the CPU): the fixed cost of a step is the decodes' anyway, so
    the chunk is weighed by the prompt's time per token; the policy's chunk is the smallest
    within the slack of the least, every decode running beside it."""
    g = random.Random(seed)
    print(f"seed {seed}")
    scheduler = make_scheduler(max_num_seqs=16)
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 6)
    prompt = sim.add(1500, 1)
    chunks = []
    for step, chunk, decodes in prompt_steps(sim, prompt):
        assert len(step.seqs) == 7  # every decode runs beside it
        assert step.decode_s == pytest.approx(LAW.seconds(decodes), rel=1e-6)
        wanted = min(1500 - chunk.start_pos, 2048 - 6)
        check_efficient(len(chunk.token_ids), decodes, wanted, step.decode_s)
        chunks.append(len(chunk.token_ids))
    assert sum(chunks) == 1500 and 3 < len(chunks) < 20
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_with_graphed_decodes_a_chunk_outweighs_the_eager_steps_gap(seed):
    """Decode steps replayed as CUDA graphs at 10% of the eager law (as on a GPU, where eager
    launches dominate small steps): a mixed step, being eager, costs the decodes the gap
    whatever its chunk; the chunk is weighed by that too (its time over the graphed step)."""
    g = random.Random(seed + 7)
    print(f"seed {seed + 7}")
    scheduler = make_scheduler(max_num_seqs=16)
    model = scheduler.cost_models.cpu
    teach(model, g)
    assert model.ready
    sim = Simulation(scheduler, g)
    decodes = start_decodes(sim, 6)
    for _ in range(200):
        shape = StepShape()
        for r in decodes:
            shape = shape.plus_seq(r.num_tokens - 1, 1)
        model.observe(shape, 0.1 * LAW.seconds(shape), decode_only=True, graphed=True)
    prompt = sim.add(1500, 1)
    chunks = []
    for step, chunk, decode_shape in prompt_steps(sim, prompt):
        graphed, eager = model.decode_seconds(decode_shape), model.seconds(decode_shape)
        assert graphed == pytest.approx(0.1 * eager, rel=0.02)
        assert step.decode_s == pytest.approx(graphed, rel=1e-6)
        wanted = min(1500 - chunk.start_pos, 2048 - 6)
        check_efficient(len(chunk.token_ids), decode_shape, wanted, step.decode_s)
        chunks.append(len(chunk.token_ids))
    assert sum(chunks) == 1500
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def streaming_scheduler(g: random.Random, threshold: int, **config) -> Scheduler:
    scheduler = make_scheduler(max_num_seqs=16, **config)
    teach(scheduler.cost_models.cpu, g)
    teach(scheduler.cost_models.streamed, g, STREAM_LAW)
    scheduler.cost_models = StepCostModels(scheduler.cost_models.cpu,
                                           scheduler.cost_models.streamed, threshold)  # fmt: skip
    return scheduler


def test_a_chunk_streams_where_streaming_is_faster_and_is_never_cut_below_the_threshold(seed):
    g = random.Random(seed + 8)
    print(f"seed {seed + 8}")
    scheduler = streaming_scheduler(g, threshold=200)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 6)
    prompt = sim.add(1500, 1)
    steps = list(prompt_steps(sim, prompt))
    for step, chunk, decodes in steps:
        remaining = 1500 - chunk.start_pos
        wanted = min(remaining, 2048 - 6)
        if remaining >= 200:
            check_efficient(len(chunk.token_ids), decodes, wanted, step.decode_s, STREAM_LAW,
                            least=200)  # fmt: skip
    assert len(steps[0][1].token_ids) >= 200
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_a_stall_target_bounds_the_step_but_not_below_the_streaming_threshold(seed):
    g = random.Random(seed + 9)
    print(f"seed {seed + 9}")
    scheduler = streaming_scheduler(g, threshold=200, max_decode_stall_ms=1.0)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 4)
    prompt = sim.add(900, 1)
    for step, chunk, decodes in prompt_steps(sim, prompt):
        remaining = 900 - chunk.start_pos
        if remaining >= 200:  # streaming is faster: the threshold, though over the target
            assert len(chunk.token_ids) == 200
        else:  # through the CPU: what 1 ms allows, the floor at least
            n = largest_chunk(decodes, chunk.start_pos, step.decode_s + 1e-3, remaining)
            assert len(chunk.token_ids) == max(n, min(FLOOR, remaining))
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_a_stall_target_keeps_each_step_within_it(seed):
    g = random.Random(seed + 10)
    print(f"seed {seed + 10}")
    scheduler = make_scheduler(max_num_seqs=16, max_decode_stall_ms=200.0)
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 6)
    prompt = sim.add(1500, 1)
    for step, chunk, decodes in prompt_steps(sim, prompt):
        remaining = 1500 - chunk.start_pos
        within = largest_chunk(decodes, chunk.start_pos, step.decode_s + 0.2, remaining)
        assert len(chunk.token_ids) <= max(within, FLOOR)
        assert LAW.seconds(StepShape.of(step.seqs)) <= step.decode_s + 0.2 + 1e-9
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_without_decodes_a_prompt_gets_the_whole_token_budget(seed):
    g = random.Random(seed + 1)
    scheduler = make_scheduler(max_num_batched_tokens=512)
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    prompt = sim.add(1300, 4)
    sizes = []
    while not prompt.output:
        step = sim.step()
        assert step.decode_s is None
        sizes.append(step.num_tokens)
    assert sizes == [512, 512, 276]


@pytest.mark.parametrize("target_ms", [None, 5.0])
def test_before_the_model_has_a_fit(seed, target_ms):
    """No steps seen yet: beside decodes a prompt gets what the token budget leaves (those
    steps teach the model), or under a stall target the floor, once a step (two prompts take
    turns); either way they complete."""
    g = random.Random(seed + 2)
    scheduler = make_scheduler(min_prefill_chunk_tokens=16, max_decode_stall_ms=target_ms)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 3)
    scheduler.cost_models = StepCostModels(StepCostModel(), StepCostModel())  # forgotten
    prompts = [sim.add(400, 1), sim.add(300, 1)]
    first = sim.step()
    chunks = [len(s.token_ids) for s in first.seqs if s.request in prompts]
    assert chunks == ([400, 300] if target_ms is None else [16])  # waiting: in arrival order
    assert first.decode_s is None
    while not all(p.output for p in prompts):
        step = sim.step()
        fed = [len(s.token_ids) for s in step.seqs if s.request in prompts]
        if target_ms is not None and not scheduler.cost_models.cpu.ready:
            assert sum(fed) <= 16, fed
    for p in prompts:
        assert sim.fed[p.request_id] == p.prompt_ids


def test_a_tiny_stall_target_feeds_the_floor_once_per_step(seed):
    g = random.Random(seed + 3)
    scheduler = make_scheduler(max_decode_stall_ms=1e-3, min_prefill_chunk_tokens=5)
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 2)
    prompts = [sim.add(23, 2), sim.add(9, 2)]
    while not all(p.output for p in prompts):
        step = sim.step()
        if decode_rows(step):
            prompt_tokens = sum(len(s.token_ids) for s in step.seqs if s.request in prompts
                                and len(s.request.output) == 0)  # fmt: skip
            assert prompt_tokens <= 5  # the floor, once per step: the second prompt waits
    for p in prompts:
        assert sim.fed[p.request_id][: len(p.prompt_ids)] == p.prompt_ids


def test_a_short_prompt_is_fed_before_a_long_prompts_next_chunk(seed):
    """A long prompt mid-prefill does not hold back a short one's first token: the short
    prompt, shorter than what the long one has left, is admitted ahead of its next chunk, and
    the long one gets what the token budget leaves."""
    g = random.Random(seed + 11)
    print(f"seed {seed + 11}")
    scheduler = make_scheduler(max_num_batched_tokens=512)
    sim = Simulation(scheduler, g)
    long = sim.add(3000, 2)
    first = sim.step()
    assert [len(s.token_ids) for s in first.seqs] == [512]
    short = sim.add(40, 2)
    second = sim.step()
    assert [(s.request, len(s.token_ids)) for s in second.seqs] == [(short, 40), (long, 472)]
    assert short.output and not long.output
    sim.run_until_done()
    assert sim.fed[long.request_id] == long.all_ids[:-1]
    assert sim.fed[short.request_id] == short.all_ids[:-1]


def test_a_cached_prefix_moves_the_chunk_to_where_its_prefill_starts(seed):
    g = random.Random(seed + 5)
    scheduler = make_scheduler(prefix_caching=True)
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    shared = [g.randrange(1, 1000) for _ in range(800)]
    first = sim.add(0, 1, prompt=shared + [5, 6, 7])
    sim.run_until_done()
    start_decodes(sim, 4)
    second = sim.add(0, 1, prompt=shared + [g.randrange(1, 1000) for _ in range(600)])
    step = sim.step()
    [chunk] = [s for s in step.seqs if s.request is second]
    assert chunk.start_pos == 800 == second.num_cached_prompt_tokens
    decodes = StepShape.of(s for s in step.seqs if s.request is not second)
    check_efficient(len(chunk.token_ids), decodes, 600, step.decode_s)
    while not second.output:
        sim.step()
    assert sim.fed[second.request_id] == second.prompt_ids
    assert first.finished


def test_preemption_beside_sized_chunks_completes_every_request(seed):
    """A cache too small for every request at once: preempted requests are recomputed (never
    one the same step feeds), and every request ends with all of its tokens fed."""
    g = random.Random(seed + 6)
    print(f"seed {seed + 6}")
    scheduler = make_scheduler(cache_tokens=256, max_num_seqs=8, max_num_batched_tokens=128,
                               min_prefill_chunk_tokens=8)  # fmt: skip
    teach(scheduler.cost_models.cpu, g)
    sim = Simulation(scheduler, g)
    requests = [sim.add(g.randrange(5, 120), g.randrange(5, 40)) for _ in range(16)]
    sim.run_until_done()
    assert any(step.preempted for step in sim.steps)
    for request in requests:
        assert request.finished and len(request.output) == request.params.max_tokens
        # its last run fed its prompt and every output token but the last, in order
        assert sim.fed[request.request_id] == request.all_ids[:-1]
    for step in sim.steps:
        fed = {id(s.request) for s in step.seqs}
        assert not any(id(r) in fed for r in step.preempted)
    kv = scheduler.kv_manager
    assert kv.num_free_blocks == kv.config.num_blocks


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(max_decode_stall_ms=0), "--max-decode-stall-ms must be > 0"),
        (dict(max_decode_stall_ms=float("nan")), "--max-decode-stall-ms must be > 0"),
        (dict(min_prefill_chunk_tokens=0), "KTSERVE_MIN_PREFILL_CHUNK_TOKENS must be >= 1"),
    ],
)
def test_bad_values_are_refused(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SchedulerConfig(**config)


def test_a_requests_ids_between_two_positions_are_those_of_its_whole_sequence(seed):
    rng = random.Random(seed)
    request = Request("r", [rng.randrange(1000) for _ in range(7)], SamplingParams())
    for n in range(5):
        request.add_output(SampledToken(rng.randrange(1000)))
        whole = request.all_ids
        assert whole == request.prompt_ids + [t.token_id for t in request.output]
        for start in range(len(whole) + 1):
            for end in range(start, len(whole) + 1):
                assert request.ids(start, end) == whole[start:end], (n, start, end)
