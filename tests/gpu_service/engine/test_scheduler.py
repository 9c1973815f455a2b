"""The scheduler's mixed steps, without a model: a real paged KV cache, a forward simulated by
advancing each sequence's cache, and step times from a known law fed to its cost model. Chunk
sizes are checked against that law by brute force (the largest chunk whose step fits the bound),
and every prompt's tokens against what it must feed: each once, in order."""

from __future__ import annotations

import random

import pytest

from gpu_service.config import SchedulerConfig
from gpu_service.engine.request import FinishReason, Request, RequestState
from gpu_service.engine.sampling import SampledToken, SamplingParams
from gpu_service.engine.scheduler import Scheduler
from gpu_service.engine.step_cost import StepCostFit, StepCostModel, StepShape
from gpu_service.kvcache.config import KVCacheConfig

LAW = StepCostFit(fixed_s=0.05, per_token_s=0.002, per_pair_s=2e-7)
BLOCK = 4
FLOOR = SchedulerConfig().min_prefill_chunk_tokens


def make_scheduler(cache_tokens: int = 8192, prefix_caching: bool = False,
                   **config) -> Scheduler:  # fmt: skip
    kv = KVCacheConfig(num_layers=1, entry_shapes=((1,),), max_num_tokens=cache_tokens,
                       block_size=BLOCK, enable_prefix_caching=prefix_caching)  # fmt: skip
    return Scheduler(SchedulerConfig(**{"max_model_len": 4096, **config}), kv)


def teach(scheduler: Scheduler, g: random.Random, n: int = 24) -> None:
    """Steps of decode rows, some with a prompt chunk, timed by LAW."""
    for _ in range(n):
        shape = StepShape()
        for _ in range(g.randrange(1, 9)):
            shape = shape.plus_seq(g.randrange(1, 300), 1)
        if g.random() < 0.6:
            shape = shape.plus_seq(g.randrange(0, 2000), g.randrange(2, 400))
        scheduler.cost_model.observe(shape, LAW.seconds(shape))


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
        if self.scheduler.cost_model is not None and step.seqs:
            self.scheduler.cost_model.observe(StepShape.of(step.seqs), LAW.seconds(
                StepShape.of(step.seqs)))  # fmt: skip
        return step

    def run_until_done(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps")


def decode_rows(step) -> list:
    return [s for s in step.seqs if len(s.token_ids) == 1 and not s.request.finished]


def largest_chunk(base: StepShape, start: int, bound: float, limit: int) -> int:
    """The oracle: the largest chunk whose step LAW times within bound."""
    return max(k for k in range(limit + 1) if LAW.seconds(base.plus_seq(start, k)) <= bound)


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


def test_a_prompt_beside_decodes_gets_the_chunk_the_time_bound_allows(seed):
    g = random.Random(seed)
    print(f"seed {seed}")
    scheduler = make_scheduler(max_num_seqs=16)
    teach(scheduler, g)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 6)
    prompt = sim.add(1500, 1)
    chunks = []
    for step, chunk, decode_shape in prompt_steps(sim, prompt):
        assert len(step.seqs) == 7  # every decode runs beside it
        bound = 3.0 * LAW.seconds(decode_shape)
        assert step.time_bound_s == pytest.approx(bound, rel=1e-6)
        want = largest_chunk(decode_shape, chunk.start_pos, bound, 2048 - 6)
        want = min(max(want, FLOOR), 1500 - chunk.start_pos)
        assert abs(len(chunk.token_ids) - want) <= 1, (chunk.start_pos, want)
        assert LAW.seconds(StepShape.of(step.seqs)) <= bound * 1.001 or want == FLOOR
        chunks.append(len(chunk.token_ids))
    assert sum(chunks) == 1500 and len(chunks) > 3
    assert chunks[0] > chunks[-2]  # later chunks attend over more: smaller
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_with_graphed_decodes_a_chunk_pays_at_least_the_eager_steps_gap(seed):
    """Decode steps replayed as CUDA graphs at 10% of the eager law (as on a GPU, where eager
    launches dominate small steps): FACTOR x the graphed decode step is less than the decode rows'
    own eager step, so it would leave every chunk at the floor. The bound is the rows' eager step
    plus the larger of (FACTOR - 1) graphed decode steps and the eager-over-graphed gap."""
    g = random.Random(seed + 7)
    print(f"seed {seed + 7}")
    scheduler = make_scheduler(max_num_seqs=16)
    teach(scheduler, g)
    model = scheduler.cost_model
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
        assert eager == pytest.approx(LAW.seconds(decode_shape), rel=1e-6)
        bound = eager + max(2.0 * graphed, eager - graphed)
        assert step.time_bound_s == pytest.approx(bound, rel=1e-6)
        want = largest_chunk(decode_shape, chunk.start_pos, bound, 2048 - 6)
        want = min(want, 1500 - chunk.start_pos)
        assert want > FLOOR or want == 1500 - chunk.start_pos
        assert abs(len(chunk.token_ids) - want) <= 1, (chunk.start_pos, want)
        chunks.append(len(chunk.token_ids))
    assert sum(chunks) == 1500
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_without_decodes_a_prompt_gets_the_whole_token_budget(seed):
    g = random.Random(seed + 1)
    scheduler = make_scheduler(max_num_batched_tokens=512)
    teach(scheduler, g)
    sim = Simulation(scheduler, g)
    prompt = sim.add(1300, 4)
    sizes = []
    while not prompt.output:
        step = sim.step()
        assert step.time_bound_s is None
        sizes.append(step.num_tokens)
    assert sizes == [512, 512, 276]


def test_the_floor_feeds_a_prompt_before_the_model_has_a_fit(seed):
    """No steps seen yet: beside decodes each step carries the floor, and the prompt completes
    (those steps teach the model; later chunks follow the bound)."""
    g = random.Random(seed + 2)
    scheduler = make_scheduler(min_prefill_chunk_tokens=16)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 3)
    scheduler.cost_model = StepCostModel()  # what it knew of the decodes' steps forgotten
    prompt = sim.add(400, 1)
    first = sim.step()
    [chunk] = [s for s in first.seqs if s.request is prompt]
    assert len(chunk.token_ids) == 16 and first.time_bound_s == 0.0
    while not prompt.output:
        sim.step()
    assert sim.fed[prompt.request_id] == prompt.prompt_ids


def test_an_explicit_time_bound_and_the_floor_under_it(seed):
    g = random.Random(seed + 3)
    scheduler = make_scheduler(mixed_step_time_factor=0, mixed_step_time_ms=1e-3,
                               min_prefill_chunk_tokens=5)  # fmt: skip
    teach(scheduler, g)
    sim = Simulation(scheduler, g)
    start_decodes(sim, 2)
    prompts = [sim.add(23, 2), sim.add(9, 2)]
    while not all(p.output for p in prompts):
        step = sim.step()
        if decode_rows(step):
            assert step.time_bound_s == pytest.approx(1e-6)
            prompt_tokens = sum(len(s.token_ids) for s in step.seqs if s.request in prompts
                                and len(s.request.output) == 0)  # fmt: skip
            assert prompt_tokens <= 5  # the floor, once per step: the second prompt waits
    for p in prompts:
        assert sim.fed[p.request_id][: len(p.prompt_ids)] == p.prompt_ids


def test_policy_off_chunks_by_the_token_budget_alone(seed):
    g = random.Random(seed + 4)
    scheduler = make_scheduler(mixed_step_time_factor=0, max_num_batched_tokens=300)
    assert scheduler.cost_model is None
    sim = Simulation(scheduler, g)
    start_decodes(sim, 4)
    prompt = sim.add(700, 1)
    step = sim.step()
    assert step.time_bound_s is None
    assert [len(s.token_ids) for s in step.seqs if s.request is prompt] == [296]


def test_a_cached_prefix_moves_the_chunk_to_where_its_prefill_starts(seed):
    g = random.Random(seed + 5)
    scheduler = make_scheduler(prefix_caching=True)
    teach(scheduler, g)
    sim = Simulation(scheduler, g)
    shared = [g.randrange(1, 1000) for _ in range(800)]
    first = sim.add(0, 1, prompt=shared + [5, 6, 7])
    sim.run_until_done()
    start_decodes(sim, 4)
    second = sim.add(0, 1, prompt=shared + [g.randrange(1, 1000) for _ in range(600)])
    step = sim.step()
    [chunk] = [s for s in step.seqs if s.request is second]
    assert chunk.start_pos == 800 == second.num_cached_prompt_tokens
    decode_shape = StepShape.of(s for s in step.seqs if s.request is not second)
    want = largest_chunk(decode_shape, 800, step.time_bound_s, 2048 - 4)
    assert abs(len(chunk.token_ids) - max(want, FLOOR)) <= 1
    while not second.output:
        sim.step()
    assert sim.fed[second.request_id] == second.prompt_ids
    assert first.finished


def test_preemption_beside_time_bounded_chunks_completes_every_request(seed):
    """A cache too small for every request at once: preempted requests are recomputed, chunks
    stay within the bound (or the floor), and every request ends with all of its tokens fed."""
    g = random.Random(seed + 6)
    print(f"seed {seed + 6}")
    scheduler = make_scheduler(cache_tokens=256, max_num_seqs=8, max_num_batched_tokens=128,
                               min_prefill_chunk_tokens=8)  # fmt: skip
    teach(scheduler, g)
    sim = Simulation(scheduler, g)
    requests = [sim.add(g.randrange(5, 120), g.randrange(5, 40)) for _ in range(16)]
    sim.run_until_done()
    assert any(step.preempted for step in sim.steps)
    for request in requests:
        assert request.finished and len(request.output) == request.params.max_tokens
        # its last run fed its prompt and every output token but the last, in order
        assert sim.fed[request.request_id] == request.all_ids[:-1]
    for step in sim.steps:
        if step.time_bound_s:
            prompt = [len(s.token_ids) for s in step.seqs if len(s.token_ids) > 1]
            within = LAW.seconds(StepShape.of(step.seqs)) <= step.time_bound_s * 1.001
            assert within or sum(prompt) <= 8
    kv = scheduler.kv_manager
    assert kv.num_free_blocks == kv.config.num_blocks


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(mixed_step_time_factor=0.5), "--mixed-step-time-factor must be 0 (off) or >= 1"),
        (dict(mixed_step_time_factor=float("nan")), "--mixed-step-time-factor must be 0"),
        (dict(mixed_step_time_ms=0), "KTSERVE_MIXED_STEP_TIME_MS must be > 0"),
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
