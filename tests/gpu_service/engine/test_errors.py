"""What a failed step ends its requests with (engine/errors.py: step_error): the expert path's
own error (gpu_service/experts/errors.py, which knows nothing of the engine) as the engine's
ExpertsUnavailable, which the API answers with 503; anything else as StepFailed."""

from __future__ import annotations

from gpu_service.api.errors import ENGINE_ERRORS
from gpu_service.engine import errors
from gpu_service.experts.errors import ExpertsUnavailable as TransportUnavailable


def test_the_expert_paths_error_ends_requests_as_experts_unavailable():
    cause = TransportUnavailable("expert worker 127.0.0.1:1 gave no answer in 2 s")
    error = errors.step_error(cause)
    assert type(error) is errors.ExpertsUnavailable
    assert str(error) == str(cause) and error.__cause__ is cause
    assert isinstance(error, TransportUnavailable)  # caught where the transport's is
    assert ENGINE_ERRORS[errors.ExpertsUnavailable][0] == 503


def test_an_engine_error_passes_and_anything_else_is_a_step_failure():
    own = errors.ExpertsUnavailable("gone")
    assert errors.step_error(own) is own
    failed = errors.step_error(KeyError("boom"))
    assert type(failed) is errors.StepFailed and isinstance(failed.__cause__, KeyError)
