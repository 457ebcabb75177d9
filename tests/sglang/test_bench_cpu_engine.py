"""``benchmarks/bench_cpu_engine.py --quick`` (tiny model): the JSON has the issue's keys for
both dtypes and auto's choice, and every figure is a positive number."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.engine]


def _check_one_dtype(report: dict) -> None:
    batches = {"1", "2", "4", "8", "16", "32"}
    assert set(report["hf_tok_s"]) == set(report["engine_tok_s"]) == {"1", "8", "32"}
    assert set(report["verify_over_plain"]) == batches
    assert set(report["step_over_roofline"]) == {"plain", "verify"}
    assert set(report["step_over_roofline"]["plain"]) == batches
    assert set(report["step_over_roofline"]["verify"]) == {"1", "2", "4", "8"}
    figures = [*report["hf_tok_s"].values(), *report["engine_tok_s"].values(),
               *report["verify_over_plain"].values(),
               *report["step_over_roofline"]["plain"].values(),
               *report["step_over_roofline"]["verify"].values()]
    assert all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in figures)
    assert report["roofline"]["bandwidth_gb_s"] > 0


def test_quick_run_writes_the_report(tmp_path):
    """Both dtypes, each against HF in its dtype, what auto picked and how it compares."""
    from benchmarks import bench_cpu_engine

    out = tmp_path / "cpu_engine.json"
    assert bench_cpu_engine.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["auto_dtype"] in ("float32", "bfloat16") and isinstance(report["cpu_flags"], list)
    assert report["dtype"] == report["auto_dtype"]  # the top-level figures are auto's dtype
    assert set(report["by_dtype"]) == {"float32", "bfloat16"}
    for dtype, figures in report["by_dtype"].items():
        assert figures["dtype"] == dtype
        _check_one_dtype(figures)
    _check_one_dtype(report)
    compared = report["dtypes"]
    assert set(compared) == {"fp32_over_bf16_tok_s", "fp32_step_over_bf16", "auto_over_best_tok_s"}
    assert all(0 < r <= 1.0 for r in compared["auto_over_best_tok_s"].values())
    assert len(report["decode_probe"]["float32"]) == 3 and report["decode_probe"]["describe"]
