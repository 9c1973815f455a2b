"""The device hand-off kernels (device_kernels.py) as Triton compiles them for Hopper, read in
their PTX: each bell is stored by one thread of one program, after its fence. Triton runs inline
asm in every thread; when every thread of the last program stored POSTED, a late store re-posted
a call the worker had already claimed, the worker ran it twice, and its second reply_bell = 1
answered the slot's next call early with the old reply (wrong logits on CUDA, issue 43;
tools/probe_handoff.py counts it on a GPU). The compile needs no GPU: Triton's own ptxas."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]

# NOTE: a process of its own: the tests' conftest turns Triton's interpreter on without a GPU,
# and an interpreted kernel cannot be compiled
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpu_service.experts import device_kernels as dk

target = GPUTarget("cuda", 90, 32)
post = {"x_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "x_dst": "*bf16",
        "ids_dst": "*i32", "weights_dst": "*fp32", "counter_ptr": "*i32", "bell_address": "i64",
        "stamps_ptr": "*i64", "prev_stamps_ptr": "*i64", "num_x": "i32", "num_routes": "i32",
        "BLOCK": "constexpr", "ROUTES": "constexpr", "STAMPS": "constexpr",
        "HAS_PREV": "constexpr"}
collect = {"reply_ptr": "*fp32", "out_ptr": "*fp32", "counter_ptr": "*i32",
           "reply_bell_address": "i64", "request_bell_address": "i64", "stamps_ptr": "*i64",
           "num_out": "i32", "BLOCK": "constexpr", "ACCUMULATE": "constexpr",
           "STAMPS": "constexpr"}
out = {}
for stamps in (False, True):
    src = ASTSource(fn=dk._post_kernel, signature=post, constexprs={
        "BLOCK": dk.BLOCK, "ROUTES": 64, "STAMPS": stamps, "HAS_PREV": stamps})
    out[f"post stamps={stamps}"] = triton.compile(src, target=target).asm["ptx"]
    src = ASTSource(fn=dk._collect_kernel, signature=collect, constexprs={
        "BLOCK": dk.BLOCK, "ACCUMULATE": stamps, "STAMPS": stamps})
    out[f"collect stamps={stamps}"] = triton.compile(src, target=target).asm["ptx"]
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)  # fmt: skip
    if run.returncode != 0:
        if "ptxas" in run.stderr and ("not found" in run.stderr or "No such file" in run.stderr):
            pytest.skip(f"Triton cannot compile for CUDA here: {run.stderr.strip()[-300:]}")
        raise AssertionError(f"compiling the hand-off kernels failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def bell_stores(text: str) -> list[str]:
    """The kernel's volatile 32-bit stores (the bells: the request region is written by plain
    stores), each with the asm block it sits in."""
    blocks = re.findall(r"\{[^{}]*st\.volatile[^{}]*\}|^[^{}\n]*st\.volatile[^\n]*$", text,
                        flags=re.MULTILINE)  # fmt: skip
    return blocks


@pytest.mark.parametrize("kernel", ["post", "collect"])
@pytest.mark.parametrize("stamps", [False, True])
def test_each_bell_is_stored_by_thread_zero_alone_after_a_fence(ptx, kernel, stamps):
    text = ptx[f"{kernel} stamps={stamps}"]
    stores = bell_stores(text)
    # post: request_bell = POSTED; collect: reply_bell = 0, then request_bell = IDLE
    assert len(stores) == (1 if kernel == "post" else 2), stores
    for block in stores:
        guard = re.search(r"@(\w+)\s+st\.volatile\.global\.u32", block)
        assert guard, f"a bell store every thread runs:\n{block}"
        pred = guard.group(1)
        tid = re.search(r"mov\.u32\s+(\w+),\s*%tid\.x;", block)
        assert tid, f"the store's guard is not made from the thread's index:\n{block}"
        assert re.search(rf"setp\.eq\.u32\s+{pred},\s*{tid.group(1)},\s*0;", block), block
        assert block.index("fence.sc.sys") < block.index("st.volatile"), block
