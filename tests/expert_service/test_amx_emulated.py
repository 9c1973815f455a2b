"""ktk_amx.cpp's logic (tile shapes and strides, 16-row chunks, the VNNI tails, padding) on any
AVX-512 CPU: the extension is rebuilt with KTSERVE_KERNEL_AMX_EMULATE=1, which runs the AMX unit on
software tiles (expert_service/kernels/ktk_amx_emu.h), into a temporary tree, and test_kernels.py
runs there in a subprocess, where `amx` is one of the ISAs it checks against the torch reference
and against AVX2. Real tiles are checked by the same test_kernels.py on an AMX machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expert_service.kernels import available_isas

ROOT = Path(__file__).resolve().parents[2]


def emulated_tree(root: Path) -> Path:
    """The kernel package with an emulated-AMX extension, and the kernel tests, under root."""
    env = {**os.environ, "KTSERVE_KERNEL_AMX_EMULATE": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(root / "build"),
         "--build-lib", str(root / "tree")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-4000:]
    tree = root / "tree"
    kernels = tree / "expert_service" / "kernels"
    assert list(kernels.glob("_ext*.so")), "the emulated build wrote no extension"
    shutil.copy(ROOT / "expert_service" / "__init__.py", tree / "expert_service")
    for source in (ROOT / "expert_service" / "kernels").glob("*.py"):
        shutil.copy(source, kernels)
    tests = tree / "tests" / "expert_service"
    tests.mkdir(parents=True)
    for name in ("__init__.py", "conftest.py"):
        shutil.copy(ROOT / "tests" / name, tree / "tests")
    for name in ("__init__.py", "test_kernels.py"):
        shutil.copy(ROOT / "tests" / "expert_service" / name, tests)
    shutil.copytree(ROOT / "tests" / "support", tree / "tests" / "support")
    return tree


@pytest.mark.skipif("avx512" not in available_isas(), reason="the AMX unit needs AVX-512 around it")
def test_kernel_suite_passes_on_emulated_amx(tmp_path, seed):
    tree = emulated_tree(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "KTSERVE_KERNEL_ISA"}
    env["KTSERVE_TEST_SEED"] = str(seed)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
         "tests/expert_service/test_kernels.py"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed_on_amx = re.findall(r"^PASSED \S+\[[^\]]*\bamx\b[^\]]*\]", run.stdout, re.MULTILINE)
    assert len(passed_on_amx) >= 50, f"only {len(passed_on_amx)} amx cases passed"
