"""bench_decode.run_batch times decode from every request's first token on, on a real two-process
service: the prefill's step is neither timed nor counted, and the caller's snapshot runs once,
after the last first token and before the last request ends."""

from __future__ import annotations

from bench.bench_decode import histogram_sum, run_batch
from tests.support.expert_procs import no_segments_left_behind  # noqa: F401 - autouse
from tests.support.worker_services import tiny_served


def test_decode_is_timed_from_the_first_tokens_on(tmp_path, seed):
    with tiny_served(tmp_path, seed, max_model_len=256, kv_cache_tokens=2048) as service:
        steps = service.metrics.step_seconds
        snapshots = []

        def after_prefill() -> None:
            snapshots.append(histogram_sum(steps, phase="gpu")[1])

        before = histogram_sum(steps, phase="gpu")[1]
        tokens = 12
        got = run_batch(service, 2, tokens, after_prefill=after_prefill)
        total = histogram_sum(steps, phase="gpu")[1] - before
        assert len(snapshots) == 1
        assert snapshots[0] > before, "the snapshot comes after the prefill's step"
        # 11 decode steps follow the prefill's; the snapshot may land after the first of them
        # (or a few more, on a busy machine)
        assert tokens // 2 <= got["steps"] <= tokens - 1
        assert got["steps"] < total, "the prefill's step is not counted"
        assert got["tok/s"] > 0
