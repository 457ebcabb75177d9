"""``benchmarks/bench_cpu_engine.py --quick`` (tiny model): the JSON has the issue's keys and
every figure is a positive number."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_quick_run_writes_the_report(tmp_path):
    from benchmarks import bench_cpu_engine

    out = tmp_path / "cpu_engine.json"
    assert bench_cpu_engine.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] in ("float32", "bfloat16") and isinstance(report["cpu_flags"], list)
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
