"""What travels on a worker's ktshm channel: message kinds, array layouts, reply statuses.

    request  KIND_MOE / KIND_MOE_BF16_OUT, layer = model layer index, num_tokens = T
             arrays: x [T, H] float32 | bfloat16, ids [T, k] int32 (global expert ids, -1 = skip),
                     weights [T, k] float32
    reply    arrays: y [T, H] float32 (KIND_MOE) or bfloat16 (KIND_MOE_BF16_OUT):
             y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), over the experts held here
    request  KIND_PING, no arrays  ->  reply with no arrays (liveness through the data path)

A reply with a non-zero status carries a message instead of arrays (ktshm.RemoteError there).
"""

from __future__ import annotations

KIND_MOE = 1
KIND_MOE_BF16_OUT = 2
KIND_PING = 3

# dtype names (ktserve.names) x may travel in; ids are int32 and weights float32 always.
X_DTYPES = ("float32", "bfloat16")
IDS_DTYPE, WEIGHTS_DTYPE = "int32", "float32"
OUT_DTYPES = {KIND_MOE: "float32", KIND_MOE_BF16_OUT: "bfloat16"}

STATUS_BAD_REQUEST = 100  # shapes/dtypes that do not match the loaded model
STATUS_NO_MODEL = 101  # nothing loaded yet
STATUS_BAD_LAYER = 102  # the layer has no routed experts
STATUS_INTERNAL = 103  # the kernel failed
STATUS_DRAINING = 104  # the worker is shutting down

STATUS_NAMES = {
    STATUS_BAD_REQUEST: "BAD_REQUEST",
    STATUS_NO_MODEL: "NO_MODEL",
    STATUS_BAD_LAYER: "BAD_LAYER",
    STATUS_INTERNAL: "INTERNAL",
    STATUS_DRAINING: "DRAINING",
}
