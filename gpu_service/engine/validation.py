"""The checks a request passes to enter the engine: the one place a prompt is validated.

Engine.add_request runs them on the caller's thread, so a refused request raises there (an HTTP
handler answers before it sends a byte) and whatever reaches the scheduler fits the context and
the KV cache. A request whose prompt fits but whose output would not is not refused: it ends with
finish_reason "length" at the context's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_service.engine.errors import InvalidPrompt, InvalidRequest, PromptTooLong
from gpu_service.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """max_model_len: prompt and output tokens together. vocab_size: token ids lie in
    [0, vocab_size). num_cache_slots: the KV cache's token slots, the most one request can hold.
    decodes_text: whether the engine has a tokenizer to match stop strings with."""

    max_model_len: int
    vocab_size: int
    num_cache_slots: int
    decodes_text: bool

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequest (InvalidPrompt, PromptTooLong) for a request that cannot run."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidPrompt("the prompt is empty; it needs at least one token")
        if n >= self.max_model_len:
            raise PromptTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {n} tokens, which leaves no room for a completion"
            )
        if n + 1 > self.num_cache_slots:
            raise PromptTooLong(
                f"the prompt has {n} tokens; with one generated token it can never fit the KV "
                f"cache ({self.num_cache_slots} token slots)"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidPrompt(f"prompt token ids must be in [0, {self.vocab_size})")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequest(f"{name} token ids must be in [0, {self.vocab_size})")
        if params.stop and not self.decodes_text:
            raise InvalidRequest("stop strings need a tokenizer; this engine has none")
