"""What the engine refuses a request with, or ends one with. These know nothing of HTTP: the API
turns them into statuses with one table (gpu_service/api/errors.py).

    EngineError
    ├── InvalidRequest        refused by add_request: the request can never run here
    │   └── InvalidPrompt     an empty prompt, or token ids outside the vocabulary
    │       └── PromptTooLong no room left for a completion (context length, KV cache)
    ├── EngineStopped         the engine is stopping: refused, or ended while in flight
    ├── RequestAborted        abort(request_id) ended it
    ├── DeadlineExceeded      its deadline passed (the API ends it and aborts it here)
    ├── ExpertsUnavailable    an expert worker gave no answer within its deadline
    ├── KVCacheTooSmall       the request outgrew what the KV cache can ever hold
    └── StepFailed            the step raised anything else (chained as its __cause__)
"""

from __future__ import annotations

from gpu_service.experts import errors as experts_errors


class EngineError(RuntimeError):
    """A request the engine refused or ended early; the message says why."""


class InvalidRequest(EngineError):
    pass


class InvalidPrompt(InvalidRequest):
    pass


class PromptTooLong(InvalidPrompt):
    pass


class EngineStopped(EngineError):
    pass


class RequestAborted(EngineError):
    pass


class DeadlineExceeded(EngineError):
    pass


class ExpertsUnavailable(EngineError, experts_errors.ExpertsUnavailable):
    """No answer from an expert worker within the deadline (the experts' own error, as the
    engine ends requests with it)."""


class KVCacheTooSmall(EngineError):
    pass


class StepFailed(EngineError):
    pass


def step_error(exc: Exception) -> EngineError:
    """What a step that raised `exc` ends its requests with: exc itself if it is an EngineError,
    the experts' ExpertsUnavailable as the engine's, else a StepFailed; each chains exc."""
    if isinstance(exc, EngineError):
        return exc
    if isinstance(exc, experts_errors.ExpertsUnavailable):
        unavailable = ExpertsUnavailable(str(exc))
        unavailable.__cause__ = exc
        return unavailable
    error = StepFailed(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
