"""Shared pytest setup: the repo root (the packages) and `tests/` (helper modules such as
checkpoints.py) are importable however pytest is started."""

import os
import random
import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
# NOTE: the repo root goes first so that `expert_service` is the package, not tests/expert_service.
for _path in (str(_TESTS_DIR.parent), str(_TESTS_DIR)):
    if _path in sys.path:
        sys.path.remove(_path)
sys.path[:0] = [str(_TESTS_DIR.parent), str(_TESTS_DIR)]


@pytest.fixture(scope="module")
def seed() -> int:
    """The module's random seed, printed; KTSERVE_TEST_SEED=N reproduces a run."""
    value = int(os.environ.get("KTSERVE_TEST_SEED", random.randrange(2**31)))
    print(f"seed={value} (KTSERVE_TEST_SEED={value} reproduces it)")
    return value
