"""tools/bench_prefetch.py's pieces: which experts a call reads ahead, its flags, and its table."""

from __future__ import annotations

import pytest
import torch

from tools.bench_prefetch import AGAIN, Sample, distinct_experts, parse, report


def test_a_calls_experts_each_once_in_the_order_its_tokens_name_them():
    ids = torch.tensor([[5, 2], [2, 7], [-1, 5]], dtype=torch.int32)
    assert distinct_experts(ids) == [5, 2, 7]


def test_flags_take_counts_and_again_and_refuse_the_rest():
    cfg = parse(["--experts", "0,2,again", "--shape", "dsv3", "--cold", "flush"])
    assert cfg.experts == (0, 2, AGAIN) and cfg.shape == "dsv3" and cfg.cold == "flush"
    assert parse([]).experts == (0, 1, 2, 4, 8, AGAIN) and parse([]).cold == "rotate"
    for bad in (["--experts", "1,x"], ["--experts", "-2"], ["--calls", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_the_table_sets_each_row_against_the_cold_call(capsys):
    cfg = parse(["--experts", "0,2,again"])
    samples = {
        0: Sample(read_us=[1.0, 1.0, 1.0], call_us=[200.0, 210.0, 190.0]),
        2: Sample(read_us=[100.0, 100.0, 100.0], call_us=[180.0, 180.0, 180.0]),
        AGAIN: Sample(read_us=[200.0, 200.0, 200.0], call_us=[150.0, 150.0, 150.0]),
    }
    report(cfg, samples, dram=90.0, expert_mb=2.5, copies=3)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[3:]]
    cells = [[c.strip() for c in r] for r in rows]
    assert cells[0][:6] == ["0", "0.0", "1.0", "200.0", "192.0-208.0", "1.000"]
    # 2 experts: 5 MB read in 100 us took 20 us off a 200 us call
    assert cells[1][0:2] == ["2", "5.0"] and cells[1][5:] == ["0.900", "0.20"]
    assert cells[2][0:2] == ["again", ""] and cells[2][5:] == ["0.750", ""]
