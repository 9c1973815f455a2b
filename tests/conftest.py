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


# One random seed per run, printed with pytest's summary (a test that fails after the fixture's
# first use does not show the fixture's own print); KTSERVE_TEST_SEED=N reproduces a run.
RUN_SEED = int(os.environ.get("KTSERVE_TEST_SEED", random.randrange(2**31)))


@pytest.fixture(scope="module")
def seed() -> int:
    """The run's random seed (every module that randomizes starts from it), printed."""
    print(f"seed={RUN_SEED} (KTSERVE_TEST_SEED={RUN_SEED} reproduces it)")
    return RUN_SEED


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"random seed {RUN_SEED}: KTSERVE_TEST_SEED={RUN_SEED} reproduces")
