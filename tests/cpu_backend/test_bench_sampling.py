"""``benchmarks/bench_sampling.py --quick --no-engine``: both draws are timed at every batch and
every figure is a positive number."""

from __future__ import annotations

import json
import math


def test_quick_ops_run_writes_the_report(tmp_path):
    from benchmarks import bench_sampling

    out = tmp_path / "sampling.json"
    assert bench_sampling.main(["--quick", "--no-engine", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert isinstance(report["cpu_flags"], list) and report["threads"] == 1
    assert set(report["ops"]) == {str(b) for b in bench_sampling.OP_BATCHES}
    for row in report["ops"].values():
        assert set(row) == {"multinomial_ms", "inverse_cdf_ms", "multinomial_over_inverse_cdf"}
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in row.values())
