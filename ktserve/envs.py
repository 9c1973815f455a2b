"""Every `KTSERVE_*` environment variable ktserve reads: its name, how its value is read, its
default and what it does (docs/serving.md's table of them is generated from this module).

Flags are what a user decides; an environment variable is an experiment's switch (the defaults
are the fast path), a secret that must stay off the command line, or plumbing between the
processes ktserve starts. `ktserve serve` reads its experiment switches once, when it builds its
config from the command line (`env_field` in ktserve/config_flags.py); a config built in code
takes its fields as given. Unset or empty is the default; a value that does not parse is a
ValueError naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ktserve.wire import X_DTYPES

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
KINDS = ("experiment", "setting", "process", "test")


def boolean(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"expected 1 or 0 (or {'/'.join(TRUE_WORDS[1:] + FALSE_WORDS[1:])})")


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number") from None


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def as_is(text: str) -> str:
    return text


def lowercase(text: str) -> str:
    return text.lower()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: `values` names what it takes (for the docs), `kind` is one of
    KINDS, `default` what unset or empty means."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    values: str
    kind: str
    doc: str

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable's value in environ (default: this process's), parsed; unset: default."""
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r}: {exc}") from None


ENV_VARS: dict[str, EnvVar] = {}


def _var(name: str, parse: Callable[[str], Any], default: Any, values: str, kind: str,
         doc: str) -> EnvVar:  # fmt: skip
    assert kind in KINDS and name not in ENV_VARS
    ENV_VARS[name] = var = EnvVar(name, parse, default, values, kind, " ".join(doc.split()))
    return var


# Experiment switches of `ktserve serve` (read when its config is built from the command line).
FLASHMLA = _var(
    "KTSERVE_FLASHMLA",
    boolean,
    True,
    "1|0",
    "experiment",
    """0: keep ktserve's own MLA decode kernels even where FlashMLA (the sgl-flash-mla package,
    on a Hopper GPU) would serve. By default an MLA model's decode attention runs on FlashMLA
    where it loads, over 64-token cache blocks (gpu_service/attention/mla_decode_flashmla.py).""",
)
FUSED_KERNELS = _var(
    "KTSERVE_FUSED_KERNELS",
    boolean,
    True,
    "1|0",
    "experiment",
    """0: on CUDA, run RMSNorm, the rotary embedding and the MoE routers' top-k as torch's
    elementwise steps. By default each is one Triton kernel computing the same float32 math
    (gpu_service/layers/fused_ops.py).""",
)
GRAPH_EXPERT_CALLS = _var(
    "KTSERVE_GRAPH_EXPERT_CALLS",
    boolean,
    True,
    "1|0",
    "experiment",
    """0: with CUDA graphs, call the expert workers from the host between the graphs of a decode
    step's segments. By default the GPU stream itself hands each MoE layer's hidden states to the
    workers and waits for their replies, so a step is one graph (--gpu-experts and
    --expert-placement always use segments).""",
)
CHAIN_DECODE_STEPS = _var(
    "KTSERVE_CHAIN_DECODE_STEPS",
    boolean,
    True,
    "1|0",
    "experiment",
    """0: with CUDA graphs, decide and launch each decode step after the last one's tokens reach
    the host. By default a step that continues the last one, where no request waits to be
    admitted and every row samples without host state (no grammar, penalties or logprobs), is
    launched as soon as the last one's graph ends, its tokens taken from the last one's samples
    on the GPU while the host reads them; a request that ends meanwhile costs its row one step of
    computing.""",
)
DEVICE_HANDOFF = _var(
    "KTSERVE_DEVICE_HANDOFF",
    one_of("kernels", "memops"),
    "kernels",
    "kernels|memops",
    "experiment",
    """How a decode graph's expert calls reach the workers' mapped slots: kernels (two Triton
    kernels per call read and write the slot over PCIe themselves and spin on its bell; memops
    where Triton is missing) or memops (copies plus the driver's stream memory operations,
    cuStreamWriteValue / WaitValue).""",
)
WIRE_DTYPE = _var(
    "KTSERVE_WIRE_DTYPE",
    one_of(*X_DTYPES),
    "bfloat16",
    "|".join(X_DTYPES),
    "experiment",
    """dtype of the hidden states the GPU service sends to the expert workers (float32 is
    exact).""",
)
MIN_PREFILL_CHUNK_TOKENS = _var(
    "KTSERVE_MIN_PREFILL_CHUNK_TOKENS",
    integer,
    8,
    "N",
    "experiment",
    """Under --max-decode-stall-ms, a step beside decodes carries at least N prompt tokens (at
    most --max-num-batched-tokens) whatever the predicted time, so a prompt always progresses.""",
)
MAX_DEFERRED_EXPERTS_PER_TOKEN = _var(
    "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN",
    integer,
    0,
    "N",
    "experiment",
    """Expert deferral, speed for quality: each token's N lowest-weight routed experts of an MoE
    layer are computed by the CPU while the GPU runs the next layer, their output joining the
    next MoE layer's instead of their own (the last MoE layer defers none); N must be below the
    model's experts per token. 0: off.""",
)
GPU_EXPERTS_REFRESH_S = _var(
    "KTSERVE_GPU_EXPERTS_REFRESH_S",
    number,
    300.0,
    "SECONDS",
    "experiment",
    """With --gpu-experts: every SECONDS, make each layer's most used experts of that interval
    the GPU ones (counted on the GPU). 0: keep the first choice; never with
    --expert-placement.""",
)

# Settings a command line must not carry, and defaults of flags.
DEVICE = _var(
    "KTSERVE_DEVICE",
    as_is,
    None,
    "DEVICE",
    "setting",
    """The default of `ktserve serve --device`: the torch device of the GPU part, e.g. cuda:1 or
    cpu. Unset: cuda if available.""",
)
API_KEY = _var(
    "KTSERVE_API_KEY",
    as_is,
    None,
    "KEY",
    "setting",
    """The key `ktserve serve` requires as 'Authorization: Bearer KEY' on every route but
    /health, where neither --api-key-file nor KTSERVE_API_KEY_FILE names a file. Unset: no
    key.""",
)
API_KEY_FILE = _var(
    "KTSERVE_API_KEY_FILE",
    as_is,
    None,
    "PATH",
    "setting",
    """The default of `ktserve serve --api-key-file`: a file whose first line is the API key.""",
)
WORKER_TOKEN = _var(
    "KTSERVE_WORKER_TOKEN",
    as_is,
    None,
    "TOKEN",
    "setting",
    """The expert workers' control-plane token itself, where no token file is named
    (ktserve/worker_token.py).""",
)
WORKER_TOKEN_FILE = _var(
    "KTSERVE_WORKER_TOKEN_FILE",
    as_is,
    None,
    "PATH",
    "setting",
    """The default of --worker-token-file (`ktserve serve`) and --token-file (`ktserve expert`):
    a file whose first line is the workers' token.""",
)
WORKER_TOKEN_CREATE = _var(
    "KTSERVE_WORKER_TOKEN_CREATE",
    boolean,
    False,
    "1",
    "setting",
    """1: the first process to find the token file missing writes a fresh token there (0600), so
    the containers of one compose project share a token without anyone choosing it.""",
)
MEMORY_LIMIT_BYTES = _var(
    "KTSERVE_MEMORY_LIMIT_BYTES",
    integer,
    None,
    "BYTES",
    "setting",
    """The host memory an expert worker may fill with its shard, checked before it loads.
    Unset: MemAvailable in /proc/meminfo.""",
)
KERNEL_ISA = _var(
    "KTSERVE_KERNEL_ISA",
    lowercase,
    None,
    "avx2|avx512|amx",
    "setting",
    """The expert kernel's instruction set, checked against what this CPU has (`ktserve expert
    --isa` overrides it). Unset: the best this CPU has.""",
)
KERNEL_SPIN_US = _var(
    "KTSERVE_KERNEL_SPIN_US",
    integer,
    200,
    "US",
    "setting",
    """How long the expert kernel's pool threads spin for the next call before they sleep, in
    microseconds (read by the C++ kernel, expert_service/kernels/ktk_moe.cpp).""",
)

# Between the processes ktserve starts, and for benchmarks and tests.
PARENT_PID = _var(
    "KTSERVE_PARENT_PID",
    integer,
    None,
    "PID",
    "process",
    """Set by a process for the children that are to die with it (ktserve/parent_process.py);
    never set it by hand.""",
)
BENCH_SYNTHETIC_EXPERTS = _var(
    "KTSERVE_BENCH_SYNTHETIC_EXPERTS",
    boolean,
    False,
    "1|0",
    "test",
    """1: an expert worker loads a directory of synthetic (random) experts, a benchmark-only
    weight source (expert_service/synthetic_experts.py); the benchmarks under bench/ set it.""",
)
WORKER_REPLY_DELAY_US = _var(
    "KTSERVE_WORKER_REPLY_DELAY_US",
    number,
    0.0,
    "US",
    "test",
    """An expert worker holds every MoE reply back a random 0..US microseconds (a stress test of
    the device hand-off's ordering: tests/gpu_service/experts/test_handoff_stress.py).""",
)
WORKER_REPLY_DELAY_SEED = _var(
    "KTSERVE_WORKER_REPLY_DELAY_SEED",
    integer,
    0,
    "SEED",
    "test",
    """The seed of KTSERVE_WORKER_REPLY_DELAY_US's random delays.""",
)
TEST_DEVICE = _var(
    "KTSERVE_TEST_DEVICE",
    as_is,
    "cpu",
    "DEVICE",
    "test",
    """The torch device of the tests that take one (tests/conftest.py; tools/gpu_host_*.sh set
    cuda). Read by the tests only.""",
)
TEST_SEED = _var(
    "KTSERVE_TEST_SEED",
    integer,
    None,
    "SEED",
    "test",
    """The tests' random seed (tests/conftest.py prints the one it draws). Read by the tests
    only.""",
)
KERNEL_AMX_EMULATE = _var(
    "KTSERVE_KERNEL_AMX_EMULATE",
    boolean,
    False,
    "1|0",
    "test",
    """1 at build time (`python setup.py build_ext`): the expert kernel's AMX path built to run
    on CPUs without AMX, for tests/expert_service/test_amx_emulated.py. Read by setup.py only.""",
)
