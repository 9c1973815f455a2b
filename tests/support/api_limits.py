"""The API limits' server flags, a request that ignores EOS, and a stream read in parts."""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.support.api_server import (
    EXACT_FLAGS,
    ServerProcess,
)

FLAGS = (*EXACT_FLAGS, "--served-model-name", "tiny")


NO_EOS = {"ignore_eos": True}


class Stream(threading.Thread):
    """A streamed completion read on a thread: each SSE event with the time it arrived."""

    def __init__(self, server: ServerProcess, max_tokens: int, **extra) -> None:
        super().__init__(daemon=True)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
                "stream": True, **NO_EOS, **extra}  # fmt: skip
        self.conn, self.response = server.open_stream("/v1/completions", body, server.auth)
        self.events: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        if self.response.status != 200:
            self.started.set()
            return
        for line in self.response.fp:
            if line.startswith(b"data: "):
                self.events.append((time.monotonic(), line[6:].decode().strip()))
                self.started.set()

    def payloads(self) -> list:
        return [e if e == "[DONE]" else json.loads(e) for _, e in self.events]

    def close(self) -> None:
        """Drop the connection (a stream still running is aborted by the server)."""
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end
        self.join(30)
        self.conn.close()
