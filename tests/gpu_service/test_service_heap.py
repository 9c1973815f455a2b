"""A built service freezes the start-up's heap (gc.freeze), so the cyclic collector's full runs
no longer walk the model while steps run, and gives it back to the collector at close() (another
service in the process plans its memory after collecting the first one's cycles)."""

from __future__ import annotations

import gc

from gpu_service.engine.request import SamplingParams
from tests.support.checkpoints import make_tiny_checkpoint
from tests.support.expert_procs import ExpertProcess, no_segments_left_behind  # noqa: F401 - autouse
from tests.support.worker_services import worker_service


def tracked_by_collector(obj) -> bool:
    """Whether obj is in one of the collector's generations (a frozen object is in none)."""
    return any(o is obj for o in gc.get_objects())


def test_service_freezes_its_start_up_heap_until_closed(tmp_path, seed):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=seed)
    worker = ExpertProcess("--model", str(path), "--format", "bf16")
    try:
        service = worker_service(path, worker, max_model_len=128, kv_cache_tokens=512)
        model = service.engine.model
        try:
            assert gc.get_freeze_count() > 0
            assert gc.is_tracked(model) and not tracked_by_collector(model)
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            events = service.engine.generate([3, 4, 5], params)
            assert sum(len(e.tokens) for e in events) == 4
        finally:
            service.close()
        assert gc.get_freeze_count() == 0
        assert tracked_by_collector(model)
    finally:
        worker.close()
        gc.unfreeze()
