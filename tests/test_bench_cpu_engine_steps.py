"""bench_cpu_engine's verify/plain ratio reads the median step of each kind, per request."""

from __future__ import annotations

import pytest

from benchmarks.bench_cpu_engine import timeline_medians


def test_medians_per_request_step_ignore_a_slow_first_step_and_other_widths():
    timeline = [[0.0, "prefill", 4, 0.5, 4],
                [0.5, "plain", 4, 0.40, 4], [0.9, "plain", 4, 0.44, 4], [1.3, "plain", 2, 0.30, 2],
                [1.6, "verify_w8", 4, 2.00, 36],  # one-off set-up of a new row count
                [3.6, "verify_w8", 4, 0.52, 36], [4.1, "verify_w8", 4, 0.48, 36],
                [4.6, "verify_w4", 4, 0.30, 20]]
    verify, plain = timeline_medians({"timeline": timeline}, 8, min_steps=3)
    assert plain == pytest.approx(0.11)  # median of 0.10, 0.11, 0.15 s per request
    assert verify == pytest.approx(0.13)  # median of 0.5, 0.13, 0.12
    assert timeline_medians({"timeline": timeline}, 16, min_steps=3) == (None, pytest.approx(0.11))
    assert timeline_medians({"timeline": timeline}, 8, min_steps=4) == (None, None)  # too few
    assert timeline_medians({}, 8) == (None, None)
