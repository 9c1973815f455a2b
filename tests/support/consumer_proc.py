"""A ktshm consumer in its own process, driven by the tests.

usage: python -m tests.support.consumer_proc CHANNEL_NAME [--force] [--hang]

Prints "ready <epoch>" once attached. Then, per request kind:
  KIND_ECHO  (0): reply with the request's arrays plus a float64 checksum of their bytes
  KIND_HANG  (1): with --hang, print "took <seq>" and block on stdin without replying (to be
                  killed); without it, echo
  KIND_BUSY  (2): hold the GIL in pure Python for arrays[0][0] seconds, then echo
  KIND_EXIT  (3): reply, detach and exit 0
Exits when the producer goes away (PeerDied).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ktshm

KIND_ECHO, KIND_HANG, KIND_BUSY, KIND_EXIT = 0, 1, 2, 3


def checksum(arrays: list[np.ndarray]) -> np.ndarray:
    total = 0
    for a in arrays:
        total += int(np.frombuffer(a.tobytes(), dtype=np.uint8).astype(np.uint64).sum())
    return np.array([total], dtype=np.int64)


def main() -> int:
    name = sys.argv[1]
    channel = ktshm.Channel.attach(name, force="--force" in sys.argv[2:])
    print(f"ready {channel.epoch}", flush=True)
    try:
        while True:
            try:
                req = channel.recv_request(timeout=30)
            except ktshm.PeerDied:
                return 0
            except ktshm.MalformedMessage:
                continue
            if req.kind == KIND_HANG and "--hang" in sys.argv[2:]:
                print(f"took {req.seq}", flush=True)
                sys.stdin.readline()
                return 0
            if req.kind == KIND_BUSY:
                end = time.perf_counter() + float(req.arrays[0][0])
                while time.perf_counter() < end:  # NOTE: holds the GIL on purpose
                    pass
            channel.reply(req, [*req.arrays, checksum(req.arrays)], dtypes=[*req.dtypes, None])
            if req.kind == KIND_EXIT:
                return 0
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
