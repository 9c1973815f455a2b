"""Shared pytest setup: the run's random seed, the tag of its ktshm names and the device of the
tests that take one. The repo root is on sys.path (pyproject.toml's pytest `pythonpath`), so the
packages and the helpers (tests.support) import as packages."""

import os
import random
import secrets

import pytest
import torch

# The `checkpoint` and `checkpoints` fixtures every test module shares.
pytest_plugins = ["tests.support.checkpoint_fixtures"]

# One random seed per run, printed with pytest's summary (a test that fails after the fixture's
# first use does not show the fixture's own print); KTSERVE_TEST_SEED=N reproduces a run.
RUN_SEED = int(os.environ.get("KTSERVE_TEST_SEED", random.randrange(2**31)))

# NOTE: set before any test starts a process (children inherit it): every ktshm name this run
# creates carries the tag (ktshm.NAME_TAG_ENV), so the segment checks count this run's shared
# memory only, never another ktserve process's on the machine (tests/support/expert_procs.py).
os.environ["KTSHM_NAME_TAG"] = f"t{secrets.token_hex(4)}"

# NOTE: without a GPU, the Triton kernels (attention, fused norms, rotary) are tested under
# Triton's interpreter on CPU tensors. It is read when a kernel is decorated, at the import of
# its module, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def seed() -> int:
    """The run's random seed (every module that randomizes starts from it), printed."""
    print(f"seed={RUN_SEED} (KTSERVE_TEST_SEED={RUN_SEED} reproduces it)")
    return RUN_SEED


@pytest.fixture(scope="module")
def device():
    """The torch device of the tests that take it: $KTSERVE_TEST_DEVICE (default cpu; cuda where
    CUDA is absent skips them: tests/support/devices.py), printed."""
    from tests.support.devices import selected_device  # NOTE: imports torch; most tests need not

    chosen = selected_device()
    print(f"device={chosen}")
    return chosen


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"random seed {RUN_SEED}: KTSERVE_TEST_SEED={RUN_SEED} reproduces")
