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


def test_both_dtypes_are_judged_against_the_runs_best_bandwidth():
    from benchmarks import bench_cpu_engine as b

    def report(bandwidth, weight_bytes):
        steps = {str(n): 0.02 for n in b.PLAIN_BATCHES}
        gemm = {str(r): 0.001 for r in [*b.PLAIN_BATCHES, *(n * 9 for n in b.VERIFY_ROOFLINE_BATCHES)]}
        return {"plain_step_s": steps, "verify_over_plain": {str(n): 1.0 for n in b.PLAIN_BATCHES},
                "roofline": {"bandwidth_gb_s": bandwidth, "weight_bytes": weight_bytes,
                             "memory_s": weight_bytes / (bandwidth * 1e9), "gemm_s": gemm}}

    by_dtype = {"float32": report(20.0, 4e8), "bfloat16": report(40.0, 2e8)}
    b.share_bandwidth(by_dtype, 9)
    for dtype, weight_bytes in (("float32", 4e8), ("bfloat16", 2e8)):
        roof = by_dtype[dtype]["roofline"]
        assert roof["bandwidth_gb_s"] == 40.0 and roof["memory_s"] == pytest.approx(weight_bytes / 40e9)
        assert by_dtype[dtype]["step_over_roofline"]["plain"]["1"] == pytest.approx(0.02 / roof["memory_s"])
    assert by_dtype["float32"]["roofline"]["own_bandwidth_gb_s"] == 20.0
