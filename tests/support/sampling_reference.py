"""The sampler's logits processing, computed plainly (the oracle of the sampling and engine
tests)."""

from __future__ import annotations

import math

EOS = 3


def reference_processed(logits, params, prompt_ids, output_ids, eos=(EOS,)):
    out = logits.clone()
    for i, p in enumerate(params):
        row = out[i]
        if len(output_ids[i]) < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
                row[t] = -math.inf
        for t, b in p.logit_bias:
            row[t] = row[t] + b
        seen = set(prompt_ids[i]) | set(output_ids[i])
        for t in range(logits.shape[1]):
            x = float(row[t])
            if t in seen and x != -math.inf:  # transformers' RepetitionPenaltyLogitsProcessor
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            n = output_ids[i].count(t)  # OpenAI's definition
            x -= n * p.frequency_penalty + (n > 0) * p.presence_penalty
            row[t] = x
    return out
