"""profile_decode_step's split of a step's GPU timeline: the gaps between two MoE layers of one
step (collect -> next post), on a hand-written timeline of two steps of three MoE layers."""

from __future__ import annotations

from tools.profile_decode_step import describe_gap, middle_gaps


def event(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "cat": "kernel", "ph": "X"}


def two_steps() -> list[dict]:
    timeline, t = [], 0.0
    for _ in range(2):
        timeline.append(event("embedding", t, 5.0))
        t += 5.0
        for layer in range(3):
            timeline.append(event("_post_kernel", t, 2.0))
            timeline.append(event("shared_expert_gemm", t + 2.0, 10.0))
            timeline.append(event("_collect_kernel", t + 12.0, 100.0))
            t += 112.0
            if layer < 2:  # the next layer's attention, then its router, 1 us apart
                timeline.append(event(f"attention_{layer}", t + 1.0, 20.0))
                timeline.append(event("router", t + 22.0, 3.0))
                t += 25.0
        timeline.append(event("lm_head", t, 50.0))
        t += 50.0
    return timeline


def test_middle_gaps_are_the_ones_inside_a_step():
    gaps = middle_gaps(two_steps(), moe_layers=3)
    assert len(gaps) == 4  # two a step: after layers 1 and 2, never across the lm head
    for gap in gaps:
        assert gap[0]["name"] == "_collect_kernel" and gap[-1]["name"] == "_post_kernel"
        assert [e["name"] for e in gap[1:-1]] in (["attention_0", "router"],
                                                 ["attention_1", "router"])  # fmt: skip


def test_describe_gap_times_the_span_and_the_idle_before_each_kernel():
    span, rows = describe_gap(middle_gaps(two_steps(), moe_layers=3)[0])
    assert span == 25.0  # from the collect's end to the post's start
    assert rows == [["attention_0", "20.0", "1.0"], ["router", "3.0", "1.0"],
                    ["(post starts)", "-", "0.0"]]  # fmt: skip
