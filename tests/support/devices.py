"""The device that device-taking tests run on: $KTSERVE_TEST_DEVICE (default cpu), e.g. cuda on
the GPU host (tools/gpu_host_agents.sh); asked for where CUDA is absent, they skip with a reason."""

from __future__ import annotations

import os

import pytest
import torch

TEST_DEVICE_ENV = "KTSERVE_TEST_DEVICE"


def selected_device() -> torch.device:
    name = os.environ.get(TEST_DEVICE_ENV, "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{TEST_DEVICE_ENV}={name}, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{TEST_DEVICE_ENV} must name a cpu or cuda device, got {name!r}")
    return device
