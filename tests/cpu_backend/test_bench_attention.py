"""``benchmarks/bench_attention.py --quick --no-engine``: both implementations are timed on the
same cases and every figure is a positive number."""

from __future__ import annotations

import json
import math

import pytest

from rhyme_sglang.cpu_backend import attention


@pytest.mark.skipif(attention._native is None, reason="native attention not built")
def test_quick_ops_run_writes_the_report(tmp_path):
    from benchmarks import bench_attention

    out = tmp_path / "attention.json"
    assert bench_attention.main(["--quick", "--no-engine", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert isinstance(report["cpu_flags"], list) and report["threads"] == 1
    ops = report["ops"]
    kinds = {" ".join(key.split()[:2]) for key in ops}
    assert kinds == {"float32 decode", "float32 verify9", "bfloat16 decode", "bfloat16 verify9"}
    assert len(ops) == 4 * 2
    for row in ops.values():
        assert set(row) == {"torch_ms", "native_ms", "torch_over_native"}
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in row.values())
