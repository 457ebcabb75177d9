"""The time breakdown accounts each second of a window to exactly one part."""

import pytest

from rhyme_sglang.core.breakdown import TimeBreakdown, decode_kind


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_parts_add_up_and_gaps_split_into_scheduling_and_idle():
    clock = Clock()
    b = TimeBreakdown(clock=clock)
    clock.t = 101.0
    b.on_step_start(101.0)
    b.on_prefill(101.0, 0.5, requests=4, tokens=400, cached_tokens=300)
    b.on_step_end(0.1, busy=True, now=101.6)
    b.on_step_start(101.8)  # 0.2 s of scheduling: requests were in flight
    b.on_draft(0.05)
    b.on_decode(101.8, 8, 0.4, requests=4, tokens=12)
    b.on_step_end(0.1, busy=False, now=102.3)
    b.on_step_start(103.3)  # 1 s idle: nothing was in flight
    b.on_decode(103.3, 0, 0.2, requests=1, tokens=1)
    b.on_step_end(0.0, busy=False, now=103.5)
    d = b.as_dict(now=104.0)
    assert d["window_s"] == pytest.approx(4.0)
    assert d["prefill"] == {"steps": 1, "seconds": 0.5, "requests": 4, "tokens": 400,
                            "tokens_per_s": 800.0, "cached_tokens": 300}
    assert set(d["decode"]) == {"plain", "verify_w8"}
    assert d["decode"]["verify_w8"]["tokens"] == 12
    assert d["decode"]["verify_w8"]["rows"] == 4 * 9 and d["decode"]["plain"]["rows"] == 1
    assert d["schedule_s"] == pytest.approx(0.2) and d["idle_s"] == pytest.approx(1.0)
    assert d["postprocess_s"] == pytest.approx(0.2) and d["draft_s"] == pytest.approx(0.05)
    # before the first step (1 s) and after the last (0.5 s) nothing is accounted
    assert d["unaccounted_s"] == pytest.approx(4.0 - (0.5 + 0.6 + 0.2 + 0.2 + 1.0))
    assert [e[1] for e in d["timeline"]] == ["prefill", "verify_w8", "plain"]
    assert d["timeline"][0][0] == pytest.approx(1.0)


def test_reset_starts_a_new_window_and_the_timeline_stays_bounded():
    clock = Clock()
    b = TimeBreakdown(max_steps=8, clock=clock)
    for i in range(100):
        b.on_decode(100.0 + i, 1, 0.01, requests=2, tokens=3)
    b.on_decode(200.0, 16, 0.3, requests=4, tokens=9, rows=11)  # a per-request verify
    d = b.as_dict(now=200.0)
    assert d["decode"]["verify_w1"]["steps"] == 100
    assert d["decode"]["verify_w16"]["rows"] == 11
    assert len(d["timeline"]) < 8 and d["timeline_stride"] >= 16
    clock.t = 300.0
    b.reset()
    d = b.as_dict(now=301.0)
    assert d["decode"] == {} and d["timeline"] == [] and d["window_s"] == pytest.approx(1.0)
    assert decode_kind(0) == "plain" and decode_kind(4) == "verify_w4"
    with pytest.raises(ValueError):
        TimeBreakdown(max_steps=1)


def test_minor_faults_count_the_window_only():
    faults = iter([10, 25, 40, 1000, 1300])
    b = TimeBreakdown(clock=Clock(), faults=lambda: next(faults))  # window starts at 10
    assert b.as_dict(now=101.0)["minor_faults"] == 15
    assert b.as_dict(now=102.0)["minor_faults"] == 30
    b.reset()  # a new window starts at 1000
    assert b.as_dict(now=103.0)["minor_faults"] == 300


def test_minor_faults_of_this_process_grow_when_new_pages_are_touched():
    from rhyme_sglang.core.breakdown import minor_faults

    before = minor_faults()
    block = bytearray(64 << 20)  # fresh pages: mapped and zeroed on first touch
    block[:: 4096] = b"\x01" * len(block[:: 4096])
    assert minor_faults() - before >= 1000
