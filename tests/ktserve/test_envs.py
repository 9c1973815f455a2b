"""ktserve/envs.py: every KTSERVE_* variable parses its values, refuses a bad one with its name in
the message, and each experiment switch reaches the field of `ktserve serve`'s config it sets
(built from the command line, as the CLI builds it)."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from gpu_service.cli import MOVED_FLAGS
from gpu_service.config import ExpertClientConfig
from gpu_service.serve_config import ServeConfig
from ktserve import envs
from ktserve.cli import build_parser
from ktserve.config_flags import from_args

# name -> (a good value, what it reads as, a bad value; None: every text is good)
VALUES = {
    "KTSERVE_FLASHMLA": ("0", False, "maybe"),
    "KTSERVE_FUSED_KERNELS": ("off", False, "2"),
    "KTSERVE_GRAPH_EXPERT_CALLS": ("no", False, "x"),
    "KTSERVE_CHAIN_DECODE_STEPS": ("false", False, "yes please"),
    "KTSERVE_DEVICE_HANDOFF": ("memops", "memops", "copies"),
    "KTSERVE_WIRE_DTYPE": ("float32", "float32", "float16"),
    "KTSERVE_MIN_PREFILL_CHUNK_TOKENS": ("16", 16, "1.5"),
    "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN": ("1", 1, "one"),
    "KTSERVE_GPU_EXPERTS_REFRESH_S": ("30", 30.0, "30s"),
    "KTSERVE_DEVICE": ("cpu", "cpu", None),
    "KTSERVE_API_KEY": ("k", "k", None),
    "KTSERVE_API_KEY_FILE": ("/k", "/k", None),
    "KTSERVE_WORKER_TOKEN": ("t", "t", None),
    "KTSERVE_WORKER_TOKEN_FILE": ("/t", "/t", None),
    "KTSERVE_WORKER_TOKEN_CREATE": ("1", True, "sure"),
    "KTSERVE_MEMORY_LIMIT_BYTES": ("1024", 1024, "1 GiB"),
    "KTSERVE_KERNEL_ISA": ("AVX2", "avx2", None),
    "KTSERVE_KERNEL_SPIN_US": ("50", 50, "long"),
    "KTSERVE_PARENT_PID": ("1", 1, "init"),
    "KTSERVE_BENCH_SYNTHETIC_EXPERTS": ("1", True, "y"),
    "KTSERVE_WORKER_REPLY_DELAY_US": ("400", 400.0, "lots"),
    "KTSERVE_WORKER_REPLY_DELAY_SEED": ("7", 7, "seven"),
    "KTSERVE_TEST_DEVICE": ("cuda", "cuda", None),
    "KTSERVE_TEST_SEED": ("3", 3, "x"),
    "KTSERVE_KERNEL_AMX_EMULATE": ("1", True, "10"),
}
# a variable -> the path of the config field it sets from the command line
FIELDS = {
    "KTSERVE_FLASHMLA": "gpu.flashmla",
    "KTSERVE_FUSED_KERNELS": "gpu.fused_kernels",
    "KTSERVE_GRAPH_EXPERT_CALLS": "gpu.graph_expert_calls",
    "KTSERVE_CHAIN_DECODE_STEPS": "gpu.chain_decode_steps",
    "KTSERVE_DEVICE_HANDOFF": "gpu.experts.device_handoff",
    "KTSERVE_WIRE_DTYPE": "gpu.experts.wire_dtype",
    "KTSERVE_MIN_PREFILL_CHUNK_TOKENS": "gpu.scheduler.min_prefill_chunk_tokens",
    "KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN": "gpu.max_deferred_experts_per_token",
    "KTSERVE_GPU_EXPERTS_REFRESH_S": "gpu.gpu_experts_refresh_s",
    "KTSERVE_DEVICE": "gpu.device",
    "KTSERVE_API_KEY_FILE": "http.api_key_file",
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    return str(tmp_path)


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def serve_config_from_cli(model_dir: str) -> ServeConfig:
    args = build_parser(["serve"]).parse_args(["serve", model_dir])
    return from_args(ServeConfig, args)


def field(config: object, path: str) -> object:
    for name in path.split("."):
        config = getattr(config, name)
    return config


def test_every_variable_is_tested_and_documented():
    assert set(VALUES) == set(envs.ENV_VARS)
    for var in envs.ENV_VARS.values():
        assert var.name.startswith("KTSERVE_") and var.kind in envs.KINDS
        assert len(var.doc) > 40, f"{var.name}: a one-paragraph doc"


@pytest.mark.parametrize("name", sorted(VALUES))
def test_each_variable_parses_and_refuses_a_bad_value(name):
    var = envs.ENV_VARS[name]
    good, value, bad = VALUES[name]
    assert var.read({}) == var.default and var.read({name: " "}) == var.default
    assert var.read({name: good}) == value and var.read({name: f" {good} "}) == value
    if bad is not None:
        with pytest.raises(ValueError, match=f"^{name}={bad!r}: expected"):
            var.read({name: bad})


def test_every_experiment_switch_is_one_config_field():
    """The env_field()s of ServeConfig are exactly the experiment switches, each once."""

    def switches(cls: type) -> list[str]:
        hints = typing.get_type_hints(cls)
        found = []
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                found += switches(hints[f.name])
            elif "env" in f.metadata:
                found.append(f.metadata["env"].name)
        return found

    experiments = [v.name for v in envs.ENV_VARS.values() if v.kind == "experiment"]
    assert sorted(switches(ServeConfig)) == sorted(experiments)
    assert set(MOVED_FLAGS.values()) - set(experiments) <= {f"{n}=0" for n in experiments}


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_variable_reaches_the_config(name, model_dir, clean_env):
    var = envs.ENV_VARS[name]
    assert field(serve_config_from_cli(model_dir), FIELDS[name]) == var.default
    good, value, bad = VALUES[name]
    clean_env.setenv(name, good)
    assert field(serve_config_from_cli(model_dir), FIELDS[name]) == value
    if bad is not None:
        clean_env.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            serve_config_from_cli(model_dir)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("KTSERVE_MAX_DEFERRED_EXPERTS_PER_TOKEN", "-1", "must be >= 0"),
        ("KTSERVE_GPU_EXPERTS_REFRESH_S", "-1", "must be >= 0"),
        ("KTSERVE_MIN_PREFILL_CHUNK_TOKENS", "0", "must be >= 1"),
    ],
)
def test_out_of_range_values_name_the_variable(name, value, message, model_dir, clean_env):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} {message}"):
        serve_config_from_cli(model_dir)


def test_a_config_built_in_code_ignores_the_environment(model_dir, clean_env):
    clean_env.setenv("KTSERVE_WIRE_DTYPE", "float32")
    assert ExpertClientConfig().wire_dtype == envs.WIRE_DTYPE.default
    assert serve_config_from_cli(model_dir).gpu.experts.wire_dtype == "float32"
