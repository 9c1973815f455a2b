"""Graceful shutdown of the HTTP server on SIGTERM or SIGINT.

    serving ──signal──▶ draining     new requests get 503 (shutting_down), /health 503; the
                                     running ones go on
            ──all finished, or --shutdown-timeout passed (a second signal: at once)──▶
                        ending       each request left ends with EngineStopped: a stream sends
                                     its tokens so far, an error event and [DONE]; a non-streamed
                                     one gets 503 JSON
            ──every response sent (FLUSH_S at most)──▶ uvicorn stops: the socket closes, idle
                                     connections too (the engine and the workers stop after)

A signal once uvicorn stops (should_exit) is uvicorn's: SIGINT then forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from gpu_service.api.context import ApiContext
from gpu_service.engine.errors import EngineStopped

log = logging.getLogger("ktserve.serve")

FLUSH_S = 10.0  # for the ended requests' last bytes


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ApiContext, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout_s = shutdown_timeout_s
        self.num_signals = 0
        self._drain: asyncio.Task | None = None
        self._hurry: asyncio.Event | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: a signal handler, run between two bytecodes of the loop: flags only; on_tick acts.
        if self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.num_signals += 1
        if self.num_signals == 1:
            log.info("%s: no new requests; waiting up to %g s for the %d running",
                     signal.Signals(sig).name, self.shutdown_timeout_s,
                     self.ctx.admission.in_flight)  # fmt: skip

    async def on_tick(self, counter: int) -> bool:
        if self.num_signals and self._drain is None:
            self._hurry = asyncio.Event()
            self._drain = asyncio.ensure_future(self.drain())
        if self.num_signals > 1 and self._hurry is not None:
            self._hurry.set()
        return await super().on_tick(counter)

    async def drain(self) -> None:
        """Stop taking requests, let the running ones finish, end the rest; then exit."""
        admission = self.ctx.admission
        admission.draining = True
        idle = asyncio.ensure_future(admission.wait_idle(self.shutdown_timeout_s))
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait({idle, hurry}, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not (idle.done() and idle.result()):
            idle.cancel()
            error = EngineStopped(
                f"the server shut down before the request finished (--shutdown-timeout "
                f"{self.shutdown_timeout_s:g} s)"
            )
            num_ended = self.ctx.end_generations(error)
            log.warning("ended %d request(s) still running", num_ended)
            if not await admission.wait_idle(FLUSH_S):
                log.warning("%d request(s) still open; closing their connections",
                            admission.in_flight)  # fmt: skip
        self.should_exit = True
