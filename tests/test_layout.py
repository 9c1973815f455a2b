"""The test run imports the packages from this tree: not tests/expert_service, tests/gpu_service,
tests/ktserve or tests/ktshm (the same names), and not another checkout an installed copy points
at; the same in subprocesses."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.watched_process import CHILD_ENV, REPO

PACKAGES = ("expert_service", "gpu_service", "ktserve", "ktshm")


@pytest.mark.parametrize("name", PACKAGES)
def test_packages_are_this_trees_top_level_ones(name):
    assert Path(importlib.import_module(name).__file__).resolve() == REPO / name / "__init__.py"


def test_test_directories_are_packages_of_their_own():
    assert __name__ == "tests.test_layout"
    for name in PACKAGES:
        module = importlib.import_module(f"tests.{name}")
        assert Path(module.__file__).resolve() == REPO / "tests" / name / "__init__.py"


def test_subprocesses_import_this_tree_and_the_helpers():
    code = "import expert_service, tests.support.checkpoints as c\n"
    code += "print(expert_service.__file__, c.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=CHILD_ENV, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    package, helper = (Path(p).resolve() for p in out.stdout.split())
    assert package == REPO / "expert_service" / "__init__.py"
    assert helper == REPO / "tests" / "support" / "checkpoints.py"
