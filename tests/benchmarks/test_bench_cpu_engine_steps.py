"""bench_cpu_engine: the verify/plain ratio reads the median verify step, per request; the
dtype comparison."""

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


def test_compare_dtypes_reads_which_dtype_is_faster_and_what_auto_lost():
    from benchmarks.bench_cpu_engine import compare_dtypes

    fp32 = {"engine_tok_s": {"1": 40.0, "8": 200.0}, "plain_step_s": {"1": 0.030, "8": 0.040}}
    bf16 = {"engine_tok_s": {"1": 50.0, "8": 160.0}, "plain_step_s": {"1": 0.020, "8": 0.050}}
    out = compare_dtypes({"float32": fp32, "bfloat16": bf16}, "bfloat16")
    assert out["fp32_over_bf16_tok_s"] == pytest.approx({"1": 0.8, "8": 1.25})
    assert out["fp32_step_over_bf16"] == pytest.approx({"1": 1.5, "8": 0.8})  # > 1: bf16 faster
    assert out["auto_over_best_tok_s"] == pytest.approx({"1": 1.0, "8": 0.8})


def _report(b, bandwidth, weight_bytes, at_step=None):
    steps = {str(n): 0.02 for n in b.PLAIN_BATCHES}
    gemm = {str(r): 0.001 for r in [*b.PLAIN_BATCHES, *(n * 9 for n in b.VERIFY_ROOFLINE_BATCHES)]}
    report = {"plain_step_s": steps, "verify_over_plain": {str(n): 1.0 for n in b.PLAIN_BATCHES},
              "roofline": {"bandwidth_gb_s": bandwidth, "weight_bytes": weight_bytes,
                           "memory_s": weight_bytes / (bandwidth * 1e9), "gemm_s": gemm}}
    if at_step:
        report["plain_bandwidth_gb_s"] = {str(n): at_step for n in b.PLAIN_BATCHES}
        report["verify_bandwidth_gb_s"] = {str(n): at_step for n in b.PLAIN_BATCHES}
    return report


def test_both_dtypes_are_judged_against_the_runs_best_bandwidth():
    from benchmarks import bench_cpu_engine as b

    by_dtype = {"float32": _report(b, 20.0, 4e8), "bfloat16": _report(b, 40.0, 2e8, at_step=50.0)}
    b.share_bandwidth(by_dtype, 9)
    for dtype, weight_bytes in (("float32", 4e8), ("bfloat16", 2e8)):
        roof = by_dtype[dtype]["roofline"]
        # the best reading of the run: a reading around the servers' rounds counts too
        assert roof["bandwidth_gb_s"] == 50.0 and roof["memory_s"] == pytest.approx(weight_bytes / 50e9)
        strict = by_dtype[dtype]["step_over_roofline_best_bandwidth"]
        assert strict["plain"]["1"] == pytest.approx(0.02 / roof["memory_s"])
        assert strict["verify"]["8"] == pytest.approx(0.02 / roof["memory_s"])
    assert by_dtype["float32"]["roofline"]["own_bandwidth_gb_s"] == 20.0


def test_a_step_is_judged_against_the_bandwidth_read_around_its_rounds():
    from benchmarks import bench_cpu_engine as b

    report = _report(b, 40.0, 2e8, at_step=20.0)
    report["plain_bandwidth_gb_s"]["2"] = 10.0  # the machine was slow while batch 2 ran
    ratios = b.step_over_roofline(report, 9)
    assert ratios["plain"]["1"] == pytest.approx(0.02 / (2e8 / 20e9))
    assert ratios["plain"]["2"] == pytest.approx(0.02 / (2e8 / 10e9))
    assert ratios["verify"]["1"] == pytest.approx(0.02 / (2e8 / 20e9))
    # the GEMM time bounds a step where it is longer than the memory time
    report["roofline"]["gemm_s"]["4"] = 0.05
    assert b.step_over_roofline(report, 9)["plain"]["4"] == pytest.approx(0.02 / 0.05)
    # without readings at the step: the roofline's own
    assert b.step_over_roofline(report, 9, at_step=False)["plain"]["2"] == pytest.approx(0.02 / (2e8 / 40e9))


def test_bandwidth_around_averages_the_readings_before_and_after_each_batch(monkeypatch):
    from benchmarks import bench_cpu_engine as b

    readings = iter([10e9, 20e9, 40e9, 30e9])
    monkeypatch.setattr(b, "stream_bandwidth", lambda **_: next(readings))
    ran = []
    out = b.bandwidth_around((1, 2, 4), ran.append)
    assert ran == [1, 2, 4]
    assert out == pytest.approx({"1": 15.0, "2": 30.0, "4": 35.0})
