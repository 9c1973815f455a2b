"""A step's time as a function of what it computes, fitted online from measured steps.

    seconds = fixed + per_token * tokens + per_pair * attention_pairs

tokens: the rows the step runs through the model; attention_pairs: the (query, key) pairs its
attention scores, sum over sequences of n * start + n * (n + 1) / 2 for n new tokens after start
cached ones (one decode row at context c: c + 1). The engine feeds every step (`observe`); the
scheduler asks what its decode rows alone would take (`decode_seconds`) and how many prompt
tokens fit beside them in a time (`prompt_tokens_within`). Both predictions are the fit times an
EMA of measured decode-only steps over it: the eager ones for eager steps, all of them for
`decode_seconds` (on CUDA decode steps replay as graphs, quicker than the eager fit says); with
eager decodes the two are one factor, and the bound FACTOR x decode_seconds leaves the prompt
chunk (FACTOR - 1) x the decode step as measured, whatever level the fit has.

The fit is robust to a busy machine: samples are kept per size class of tokens (powers of two,
the last SAMPLES_PER_CLASS each), so the many decode steps never push out the few chunk steps that
pin the slopes; it minimizes relative error (a 50 ms step counts as much as a 5 s one), with every
term >= 0; steps far off the first fit (a stall: another process took the CPU) are dropped and
the rest fitted again. Until the samples pin a positive slope, it is not `ready`.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

SAMPLES_PER_CLASS = 8
MIN_SAMPLES = 3
OUTLIER_MADS = 4.0  # a relative residual this many deviations from the median is dropped
OUTLIER_FLOOR = 0.1  # ... and only if it is also over 10% (exact data has no spread)
MAX_CONDITION = 1e8
DECODE_RATIO_WEIGHT = 0.1  # of each decode-only step in decode_seconds' calibration


@dataclass(frozen=True)
class StepShape:
    num_tokens: int = 0
    num_attention_pairs: int = 0

    def plus_seq(self, start_pos: int, num_new: int) -> StepShape:
        """This shape with one more sequence: num_new tokens after start_pos cached ones."""
        pairs = num_new * start_pos + num_new * (num_new + 1) // 2
        return StepShape(self.num_tokens + num_new, self.num_attention_pairs + pairs)

    @classmethod
    def of(cls, seqs) -> StepShape:
        """The shape of a step's ScheduledSeqs (anything with token_ids and start_pos)."""
        shape = cls()
        for s in seqs:
            shape = shape.plus_seq(s.start_pos, len(s.token_ids))
        return shape


@dataclass(frozen=True)
class StepCostFit:
    fixed_s: float
    per_token_s: float
    per_pair_s: float

    def seconds(self, shape: StepShape) -> float:
        return (self.fixed_s + self.per_token_s * shape.num_tokens
                + self.per_pair_s * shape.num_attention_pairs)  # fmt: skip


class StepCostModel:
    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[StepShape, float]]] = {}
        self._fit: StepCostFit | None = None
        self._stale = False
        # measured decode-only steps over the fit's prediction (EMAs): all, and the eager ones
        self._decode_ratio = 1.0
        self._eager_ratio = 1.0
        self._last_decode: StepShape | None = None

    def observe(self, shape: StepShape, seconds: float, *, decode_only: bool = False,
                graphed: bool = False) -> None:  # fmt: skip
        """One measured step. A decode-only step also calibrates the predictions (`seconds` by
        the eager ones, `decode_seconds` by all); one replayed as CUDA graphs (cheaper than the
        eager steps the fit models) does only that."""
        if shape.num_tokens < 1 or not seconds > 0:
            return
        if decode_only and self._fit is not None:  # NOTE: the last fit: no refit per decode
            ratio = seconds / self._fit.seconds(shape)
            self._last_decode = shape
            self._decode_ratio += DECODE_RATIO_WEIGHT * (ratio - self._decode_ratio)
            if not graphed:
                self._eager_ratio += DECODE_RATIO_WEIGHT * (ratio - self._eager_ratio)
        if graphed:
            return
        size_class = shape.num_tokens.bit_length()
        window = self._samples.setdefault(size_class, deque(maxlen=SAMPLES_PER_CLASS))
        window.append((shape, seconds))
        self._stale = True

    @property
    def num_samples(self) -> int:
        return sum(len(w) for w in self._samples.values())

    @property
    def fit(self) -> StepCostFit | None:
        """The current fit; None until the samples pin a positive cost per token or pair."""
        if self._stale:
            old, self._fit = self._fit, _fit([s for w in self._samples.values() for s in w])
            self._stale = False
            if old is not None and self._fit is not None and self._last_decode is not None:
                # NOTE: the ratios were measured against the old fit: keep what they predict
                rescale = old.seconds(self._last_decode) / self._fit.seconds(self._last_decode)
                self._decode_ratio *= rescale
                self._eager_ratio *= rescale
        return self._fit

    @property
    def last_fit(self) -> StepCostFit | None:
        """The fit as last computed (no refit: what metrics read)."""
        return self._fit

    @property
    def ready(self) -> bool:
        return self.fit is not None

    def seconds(self, shape: StepShape) -> float | None:
        """An eager step's predicted time: the fit, calibrated by the eager decode-only steps
        measured lately (the fit's samples span loads and sizes; these are the latest)."""
        fit = self.fit
        return fit.seconds(shape) * self._eager_ratio if fit is not None else None

    def decode_seconds(self, shape: StepShape) -> float | None:
        """A decode-only step's predicted time, calibrated by the decode-only steps measured
        lately (on CUDA they replay as graphs, quicker than the eager fit says)."""
        fit = self.fit
        return fit.seconds(shape) * self._decode_ratio if fit is not None else None

    def prompt_tokens_within(self, base: StepShape, start_pos: int, seconds: float,
                             limit: int) -> int:  # fmt: skip
        """The most prompt tokens (<= limit) after start_pos cached ones that a step holding
        `base` already can add while its predicted time stays within seconds (0 if not ready)."""
        fit = self.fit
        if fit is None or limit < 1:
            return 0
        lo, hi = 0, limit  # NOTE: the prediction grows with n (every term >= 0): bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fit.seconds(base.plus_seq(start_pos, mid)) * self._eager_ratio <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _fit(samples: list[tuple[StepShape, float]]) -> StepCostFit | None:
    if len(samples) < MIN_SAMPLES:
        return None
    x = np.array([[1.0, s.num_tokens, s.num_attention_pairs] for s, _ in samples])
    t = np.array([seconds for _, seconds in samples])
    coef = _nonnegative_relative_fit(x, t)
    if coef is None:
        return None
    residual = x @ coef / t - 1.0
    median = np.median(residual)
    spread = 1.4826 * np.median(np.abs(residual - median))
    keep = np.abs(residual - median) <= max(OUTLIER_MADS * spread, OUTLIER_FLOOR)
    if not keep.all() and keep.sum() >= MIN_SAMPLES:
        coef = _nonnegative_relative_fit(x[keep], t[keep])
    if coef is None or (coef[1] <= 0 and coef[2] <= 0):
        return None
    return StepCostFit(*(float(c) for c in coef))


def _nonnegative_relative_fit(x: np.ndarray, t: np.ndarray) -> np.ndarray | None:
    """argmin over coef >= 0 of sum ((x @ coef - t) / t)^2: the best unconstrained fit over each
    subset of the columns whose terms all come out >= 0 (three columns: seven subsets), each
    from the normal equations (a 3 x 3 system: the fit runs while the engine schedules)."""
    scale = np.maximum(x.max(axis=0), 1e-30)  # NOTE: pairs run to millions: scaled columns
    rows = x / scale / t[:, None]
    gram, moment = rows.T @ rows, rows.sum(axis=0)  # [3, 3], [3]
    best, best_error = None, np.inf
    for k in (1, 2, 3):
        for columns in itertools.combinations(range(x.shape[1]), k):
            index = np.array(columns)
            sub = gram[np.ix_(index, index)]
            if np.linalg.cond(sub) > MAX_CONDITION:  # the samples do not tell these terms apart
                continue
            coef = np.linalg.solve(sub, moment[index])
            if (coef < 0).any():
                continue
            error = float(coef @ sub @ coef - 2 * coef @ moment[index])  # + len(t)
            if error < best_error:
                best = np.zeros(x.shape[1])
                best[index] = coef / scale[index]
                best_error = error
    return best
