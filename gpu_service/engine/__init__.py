"""The engine: a scheduler that decides, a runner that executes, joined by one step."""

from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.engine.engine import Engine
from gpu_service.engine.errors import EngineError
from gpu_service.engine.metrics import EngineMetrics
from gpu_service.engine.request import FinishReason, TokenEvent
from gpu_service.engine.sampling import SampledToken, SamplingParams
from gpu_service.engine.scheduler import SchedulerConfig

__all__ = [
    "DecodeGraphConfig",
    "Engine",
    "EngineError",
    "EngineMetrics",
    "FinishReason",
    "SampledToken",
    "SamplingParams",
    "SchedulerConfig",
    "TokenEvent",
]
