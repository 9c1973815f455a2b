"""`ktserve plan` as a command: its text, its --json (the Plan dataclass as a dict), sizes as
flags take them, a user's mistake as one line, and the machine's numbers where none are given."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from gpu_service.plan.cli import parse_bytes
from gpu_service.plan.memory import GPU_PARTS, PlanInputs
from gpu_service.plan.model_plan import make_plan, read_model_config
from tests.support.ktserve_command import ktserve

CONFIG = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "Qwen3-235B-A22B.json"
GIB = 2**30
DESCRIBED = ("--gpu-memory", "24GiB", "--ram", "192GiB", "--dram-gbs", "180")


def test_sizes_take_binary_and_decimal_units():
    assert parse_bytes("24GiB") == parse_bytes("24G") == 24 * GIB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert parse_bytes("4096") == 4096
    for bad in ("24 parsecs", "GiB", "-3G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_text_names_every_part_the_fit_and_the_flags_that_fix_it():
    result = ktserve("plan", str(CONFIG), *DESCRIBED)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    print(text)
    for part in GPU_PARTS:
        assert f"\n  {part} " in text
    assert "does NOT fit" in text and "To fit: --gpu-weight-format fp8" in text
    assert "DRAM 180.0 GB/s, given" in text and "largest context that fits" in text


def test_json_is_the_plan_as_a_dict():
    result = ktserve("plan", str(CONFIG), *DESCRIBED, "--json", "--expert-workers", "2")
    assert result.returncode == 0, result.stderr
    written = json.loads(result.stdout)
    inputs = PlanInputs(expert_workers=2, gpu_memory=24 * GIB, ram=192 * GIB)
    expected = make_plan(read_model_config(CONFIG), inputs, 180.0, dram_measured=False)
    assert written == json.loads(expected.to_json())
    assert written["memory"]["gpu_fits"] is False and len(written["decode"]) == 2
    assert written["memory"]["worker_expert_bytes"] == list(expected.memory.worker_expert_bytes)


def test_a_config_that_is_no_moe_model_is_one_line_and_exit_2(tmp_path):
    dense = tmp_path / "config.json"
    dense.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    result = ktserve("plan", str(dense), *DESCRIBED)
    assert result.returncode == 2
    assert (
        result.stderr.startswith("ktserve plan: error: ") and len(result.stderr.splitlines()) == 1
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to plan for")
def test_without_a_gpu_here_the_plan_asks_for_gpu_memory():
    result = ktserve("plan", str(CONFIG), "--ram", "192GiB", "--dram-gbs", "180")
    assert result.returncode == 0, result.stderr
    assert "no GPU here: pass --gpu-memory" in result.stdout
    assert "not checked" in result.stdout


def test_without_dram_gbs_the_rate_is_measured_here(monkeypatch, capsys):
    from gpu_service.plan import cli

    monkeypatch.setattr(cli, "DRAM_MEASURE_GB", 0.05)  # NOTE: a small pass: the suite's cores
    threads = torch.get_num_threads()
    try:
        args = cli_parser().parse_args(["plan", str(CONFIG), "--gpu-memory", "80GiB", "--json"])
        assert args.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    written = json.loads(capsys.readouterr().out)
    print(f"measured {written['dram_gbs']:.1f} GB/s")
    assert written["dram_measured"] is True and written["dram_gbs"] > 0
    batch1 = written["decode"][0]
    assert batch1["bound_tok_s"] == pytest.approx(
        written["dram_gbs"] * 1e9 / batch1["routed_bytes_per_token"]
    )


def cli_parser() -> argparse.ArgumentParser:
    from ktserve.cli import build_parser

    return build_parser(["plan"])
