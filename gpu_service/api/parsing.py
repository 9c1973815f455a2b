"""From an HTTP body to what the engine takes: a validated request model and SamplingParams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class SamplingFields:
    """How to sample, as every API asks it (SamplingParams less what the request's output
    decides: max_tokens, logprobs, grammar)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


def sampling_fields(body: _Sampling) -> SamplingFields:
    """The OpenAI bodies' sampling fields (400 for logit_bias keys that are not token ids)."""
    try:
        logit_bias = body.logit_bias_ids()
        if any(not -100 <= b <= 100 for _, b in logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
    except ValueError as exc:
        raise invalid(str(exc), param="logit_bias") from exc
    return SamplingFields(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias,
    )


def sampling_params(
    fields: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int, grammar=None
) -> SamplingParams:
    if fields.min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({fields.min_tokens}) is more than max_tokens ({max_tokens})",
            param="min_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            grammar=grammar,
            **{f.name: getattr(fields, f.name) for f in dataclasses.fields(fields)},
        )
    except ValueError as exc:
        raise invalid(str(exc)) from exc


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of n choices: alike but for the seed (seed + index), so seeded
    choices differ from each other and each is reproducible."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]
