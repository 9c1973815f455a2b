"""The engine: a loop thread that joins the scheduler (decides) and the runner (executes).

    loop:  take new requests and aborts from the inbox
           step = scheduler.schedule()         # who runs: decodes + admitted prefills
           result = runner.run(step)           # one forward + sampling
           update(step, result)                # append tokens, stop checks, events, free caches

A graphed decode step whose rows sample on the device is started instead, and the next decode
step chained to it while it runs (runner.py's diagram): the scheduler decides that step before
this one's tokens are known (Scheduler.chain), the runner launches it once this one's device
work is through, and this one's tokens are appended while it runs. A row whose request this
step ended (EOS, a stop string) is dropped from the chained step's results, like an aborted one.

Callers (HTTP handlers, tests) talk to it from other threads: `add_request` with a callback that
receives TokenEvents (called on the engine thread: keep it short), `abort`, and `generate` for a
blocking call. `add_request` validates the request first (validation.py) and raises the typed
error of errors.py that refused it; every request it takes ends with exactly one event carrying a
finish_reason (and, for ERROR and ABORT, the EngineError that ended it).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gpu_service.engine.decode_graphs import DecodeGraphConfig
from gpu_service.engine.detokenizer import Decode, Detokenizer
from gpu_service.engine.errors import (
    EngineError,
    EngineStopped,
    KVCacheTooSmall,
    RequestAborted,
    step_error,
)
from gpu_service.engine.metrics import EngineMetrics
from gpu_service.engine.request import FinishReason, Request, RequestState, TokenEvent
from gpu_service.engine.runner import Runner, Started, StepResult, samples_on_device
from gpu_service.engine.sampling import SamplingParams
from gpu_service.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from gpu_service.engine.step_cost import StepShape
from gpu_service.engine.validation import RequestLimits
from gpu_service.models.model import CausalLM

log = logging.getLogger("ktserve.engine")
RECENT_RUNS = 32  # requests whose run times estimate a slot's turnover (mean_run_s)

EventCallback = Callable[[TokenEvent], None]


@dataclass(eq=False)
class _Tracked:
    request: Request
    on_event: EventCallback
    detok: Detokenizer | None
    last_token_time: float = 0.0


class Engine:
    def __init__(self, model: CausalLM, scheduler_config: SchedulerConfig, *,
                 eos_token_ids: Sequence[int] = (), decode: Decode | None = None,
                 metrics: EngineMetrics | None = None, experts_stats=None,
                 graph_config: DecodeGraphConfig | None = None) -> None:  # fmt: skip
        """graph_config: decode steps as CUDA graphs (Runner); None: every step eagerly."""
        self.model = model
        self.scheduler = Scheduler(scheduler_config, model.kv_cache.config)
        self.scheduler.cost_models = replace(self.scheduler.cost_models,
                                             stream_threshold=model.stream_threshold)  # fmt: skip
        self.runner = Runner(model, graph_config, eos_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = RequestLimits(
            max_model_len=scheduler_config.max_model_len,
            vocab_size=model.config.vocab_size,
            num_cache_slots=model.kv_cache.config.num_slots,
            decodes_text=decode is not None,
        )
        self.decode = decode
        self.metrics = metrics or EngineMetrics(max_model_len=scheduler_config.max_model_len)
        # first scheduled to finished, of the last requests that ran to their end (stop, length)
        self._recent_run_s: collections.deque[float] = collections.deque(maxlen=RECENT_RUNS)
        # perf_counter when the last step's forward and sampling ended (None: that step left
        # no request running or waiting, so the time until the next one is no step's work; or
        # it failed)
        self._last_step_end: float | None = None
        self.experts_stats = experts_stats
        # a started step chained to the last one (launched, not yet collected), and the MoE
        # times when it was launched
        self._chained: tuple[ScheduledStep, Started, tuple[float, float]] | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ caller side
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """stop(), then release the decode graphs and the KV cache (the device memory goes back
        whoever still holds the engine; the model stays usable for direct forwards only after
        a new cache is set)."""
        self.stop(timeout)
        if self._thread is not None and self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s: its device memory stays "
                        "allocated", timeout)  # fmt: skip
            return
        self.runner.close()
        self.model.kv_cache.release()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                    on_event: EventCallback, request_id: str | None = None) -> str:  # fmt: skip
        """Queue a request; raises InvalidRequest (see validation.py) or EngineStopped."""
        if self._stop.is_set():
            raise EngineStopped("the engine is shutting down")
        self.limits.check(prompt_ids, params)
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params)
        detok = None
        if self.decode is not None:
            detok = Detokenizer(self.decode, params.stop, params.min_tokens)
        self._inbox.put(("add", _Tracked(request, on_event, detok)))
        self._wake.set()
        return request.request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 timeout: float = 600.0) -> list[TokenEvent]:  # fmt: skip
        """Blocking: every event of one request, the last carrying its finish_reason."""
        events: queue.Queue = queue.Queue()
        self.add_request(prompt_ids, params, events.put)
        out = []
        deadline = time.monotonic() + timeout
        while not out or out[-1].finish_reason is None:
            out.append(events.get(timeout=max(deadline - time.monotonic(), 0.001)))
        return out

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def mean_run_s(self) -> float | None:
        """Mean seconds from first scheduled to finished of the last RECENT_RUNS requests that
        ran to their end (None before the first); what one request holds a running slot."""
        runs = list(self._recent_run_s)  # NOTE: copied: the engine thread appends meanwhile
        return sum(runs) / len(runs) if runs else None

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self._chained is None and not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self.step()
        if self._chained is not None:  # NOTE: its device work ends before the caches go
            step, started, _ = self._chained
            self._chained = None
            try:
                self.runner.wait(started)
            except Exception:  # noqa: BLE001 - its requests end below
                log.exception("the last chained step failed")
        for tracked in list(self._tracked.values()):
            self._finish(tracked, FinishReason.ABORT, EngineStopped("the engine stopped"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(item.request)
                self._tracked[item.request.request_id] = item
                self.metrics.prompt_tokens.inc(len(item.request.prompt_ids))
            elif kind == "abort" and item in self._tracked:
                aborted = RequestAborted("the request was aborted")
                self._finish(self._tracked[item], FinishReason.ABORT, aborted)

    def step(self) -> None:
        """One scheduling decision and its execution (the engine thread's unit of work); a
        chained step launched by the last call is collected instead."""
        if self._chained is not None:
            step, started, moe_before = self._chained
            self._chained = None
            self._update_gauges()
            self._finish_started(step, started, moe_before)
            return
        step = self.scheduler.schedule()
        self._update_gauges()
        self.metrics.preemptions.inc(len(step.preempted))
        scheduled_at = time.monotonic()
        for s in step.seqs:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = scheduled_at
                self.metrics.queue_time.observe(scheduled_at - s.request.arrival)
        self.metrics.observe_prefix_cache(self.scheduler.kv_manager.stats)
        if not step.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing can ever run it: its prompt fit, but prompt + output outgrew the cache
                first = self._tracked[self.scheduler.waiting[0].request_id]
                error = KVCacheTooSmall(
                    f"the request grew to {first.request.num_tokens} tokens, more than the KV "
                    f"cache holds ({self.limits.num_cache_slots} token slots)"
                )
                self._finish(first, FinishReason.ERROR, error)
            return
        moe_before = self._moe_seconds()
        started = time.perf_counter()
        if self._last_step_end is not None:
            self.metrics.host_seconds.labels(part="between").observe(started - self._last_step_end)
        if self.runner.can_start(step):
            try:
                launched = self.runner.start(step)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                self._fail_step(step, exc)
                return
            self._finish_started(step, launched, moe_before)
            return
        try:
            result = self.runner.run(step)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            self._fail_step(step, exc)
            return
        self._last_step_end = time.perf_counter()
        self._complete(step, result, moe_before)

    def _finish_started(self, step: ScheduledStep, started: Started,
                        moe_before: tuple[float, float]) -> None:  # fmt: skip
        """See a started step through: chain the next one to it (decided and prepared while it
        runs, launched once its device work is through), then take its tokens."""
        self.metrics.host_seconds.labels(part="launch").observe(started.launch_seconds)
        if started.replay_seconds:
            self.metrics.host_seconds.labels(part="replay").observe(started.replay_seconds)
        chained = prepared = None
        if self.runner.chains:
            try:
                chained = self.scheduler.chain(step, samples_on_device)
                prepared = self.runner.prepare(chained, started) if chained is not None else None
            except Exception:  # noqa: BLE001 - not chained: the next step is scheduled anew
                log.exception("could not chain a decode step")
                prepared = None
        try:
            self.runner.wait(started)
        except Exception as exc:  # noqa: BLE001 - its requests (the chained one's too) end
            self._fail_step(step, exc)
            return
        launch_error = None
        if prepared is not None:
            try:
                launched = self.runner.launch(prepared)
            except Exception as exc:  # noqa: BLE001 - after this step's tokens: its requests end
                launch_error = exc
            else:
                self._chained = (chained, launched, self._moe_seconds())
                between = launched.launched_at - started.done_at
                self.metrics.host_seconds.labels(part="between").observe(between)
                self.metrics.chained_steps.inc()
        result = self.runner.collect(started)
        # NOTE: a chained step's 'between' is counted above: the next step() call collects it
        self._last_step_end = time.perf_counter() if self._chained is None else None
        self._complete(step, result, moe_before)
        if launch_error is not None:
            self._fail_step(chained, launch_error)

    def _fail_step(self, step: ScheduledStep, exc: Exception) -> None:
        """A step failed: its requests end with the typed error (the engine keeps serving)."""
        self._last_step_end = None
        log.exception("step failed", exc_info=exc)
        error = step_error(exc)
        if step.block_copies:  # NOTE: a block brought back may hold what a failed copy left
            self.scheduler.kv_manager.reset_prefix_cache()
        for s in step.seqs:
            tracked = self._tracked.get(s.request.request_id)
            if tracked is not None:
                self._finish(tracked, FinishReason.ERROR, error)

    def _complete(self, step: ScheduledStep, result: StepResult,
                  moe_before: tuple[float, float]) -> None:  # fmt: skip
        """A step's results: its metrics, then its tokens appended (stop checks, events)."""
        transfer, wait = (b - a for a, b in zip(moe_before, self._moe_seconds()))
        self.metrics.observe_step(result.seconds, transfer, wait, step.num_tokens, result.graphed)
        if result.sample_seconds:
            self.metrics.host_seconds.labels(part="sample").observe(result.sample_seconds)
        # NOTE: a streamed step costs its layers' copies whatever its size: a law of its own
        models = self.scheduler.cost_models
        cost_model = models.streamed if result.streamed else models.cpu
        decode_only = all(len(s.token_ids) == 1 and s.samples for s in step.seqs)
        cost_model.observe(StepShape.of(step.seqs), result.seconds, decode_only=decode_only,
                           graphed=result.graphed)  # fmt: skip
        self.metrics.observe_step_cost(models, step)
        now = time.monotonic()
        for s, token in zip(step.seqs, result.tokens):
            tracked = self._tracked.get(s.request.request_id)
            if token is None or tracked is None or s.request.state != RequestState.RUNNING:
                continue
            self._append(tracked, token, now)
        if not self.scheduler.has_work():  # NOTE: a request in the inbox already does not count
            self._last_step_end = None

    def _update_gauges(self) -> None:
        self.metrics.running.set(self.num_running)
        self.metrics.waiting.set(self.num_waiting)
        self.metrics.kv_usage.set(self.scheduler.kv_usage)

    def _moe_seconds(self) -> tuple[float, float]:
        stats = self.experts_stats
        return (stats.transfer_s, stats.wait_s) if stats is not None else (0.0, 0.0)

    def _append(self, tracked: _Tracked, token, now: float) -> None:
        request = tracked.request
        request.add_output(token)
        self.metrics.generation_tokens.inc()
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft.observe(now - request.arrival)
        else:
            self.metrics.itl.observe(now - tracked.last_token_time)
        tracked.last_token_time = now
        reason = None
        text = ""
        matcher = request.matcher
        if matcher is not None and (not matcher.accept(token.token_id) or matcher.done):
            reason = FinishReason.STOP  # the grammar is complete (or, failing, cannot go on)
        if tracked.detok is not None:
            text = tracked.detok.add(request.output_ids)
            if tracked.detok.stopped:
                reason = FinishReason.STOP
        p = request.params
        if reason is None:
            if token.token_id in p.stop_token_ids or (
                not p.ignore_eos and token.token_id in self.eos_token_ids
            ):
                reason = FinishReason.STOP
            elif (
                len(request.output) >= p.max_tokens
                or request.num_tokens >= self.scheduler.config.max_model_len
            ):
                reason = FinishReason.LENGTH
        if reason is not None and tracked.detok is not None and not tracked.detok.stopped:
            text += tracked.detok.flush()
        tracked.on_event(_event(request, (token,), text=text))
        if reason is not None:
            self._finish(tracked, reason, None)

    def _finish(self, tracked: _Tracked, reason: FinishReason, error: EngineError | None) -> None:
        request = tracked.request
        self.scheduler.finish(request, reason, error)
        self._tracked.pop(request.request_id, None)
        now = time.monotonic()
        self.metrics.e2e.observe(now - request.arrival)
        self.metrics.observe_finished(request, tracked.last_token_time)
        ran = request.first_scheduled_time
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and ran is not None:
            self._recent_run_s.append(now - ran)
        self.metrics.finished.labels(finished_reason=reason.value).inc()
        self._update_gauges()
        stop_string = tracked.detok.stopped_by if tracked.detok is not None else None
        tracked.on_event(_event(request, (), finish_reason=reason, error=error,
                                stop_string=stop_string))  # fmt: skip


def _event(request: Request, tokens: tuple, **fields) -> TokenEvent:
    return TokenEvent(request.request_id, tokens, num_prompt_tokens=len(request.prompt_ids),
                      num_cached_tokens=request.num_cached_prompt_tokens or 0,
                      **fields)  # fmt: skip
