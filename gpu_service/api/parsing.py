"""From an HTTP body to what the engine takes: a validated request model and SamplingParams."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gpu_service.api.context import ApiContext
from gpu_service.api.errors import from_validation, invalid
from gpu_service.api.schemas import _Sampling
from gpu_service.engine import SamplingParams

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    if not body:
        raise invalid("the request has no body; send a JSON object")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    return parsed


def check_request(ctx: ApiContext, body: _Sampling) -> None:
    """404 for another model's name, 400 for fields set to what this server cannot do."""
    ctx.check_model(body.model)
    found = body.unsupported()
    if found is not None:
        param, message = found
        raise invalid(message, param=param)


def sampling_params(
    body: _Sampling, max_tokens: int, logprobs: bool, top_logprobs: int, grammar=None
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=body.stop_strings(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            grammar=grammar,
        )
    except ValueError as exc:
        raise invalid(str(exc)) from exc
