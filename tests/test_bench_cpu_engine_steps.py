"""bench_cpu_engine's verify/plain ratio reads the median verify step, per request."""

from __future__ import annotations

import pytest

from benchmarks.bench_cpu_engine import median_verify_step


def test_median_per_request_step_ignores_a_slow_first_step_and_other_kinds():
    timeline = [[0.0, "prefill", 4, 0.5, 4], [0.5, "plain", 4, 0.40, 4],
                [1.6, "verify_w8", 4, 2.00, 36],  # one-off set-up of a new row count
                [3.6, "verify_w8", 4, 0.52, 36], [4.1, "verify_w8", 4, 0.48, 36],
                [4.6, "verify_w4", 4, 0.30, 20]]
    assert median_verify_step({"timeline": timeline}, 8) == pytest.approx(0.13)  # 0.5, 0.13, 0.12
    assert median_verify_step({"timeline": timeline}, 4) is None  # one step: too few
    assert median_verify_step({"timeline": timeline}, 4, min_steps=1) == pytest.approx(0.075)
    assert median_verify_step({}, 8) is None
