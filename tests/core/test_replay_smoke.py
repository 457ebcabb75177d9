"""The replay benchmark runs on the dev trace and returns well-formed results."""

import json
import os

import pytest

from benchmarks import replay
from rhyme_sglang.core.trace import read_trace, write_trace

TRACE = "/work/shared/data/traces_smollm2_arith_dev.jsonl.gz"
pytestmark = pytest.mark.skipif(not os.path.exists(TRACE), reason=f"dev trace missing: {TRACE}")


def _check(result, names, k, mode):
    assert result["k"] == k and result["mode"] == mode
    for name in names:
        s = result["sources"][name]
        assert set(s) == {"tau", "per_epoch", "waste", "lookup_us_p50"}
        assert 1.0 <= s["tau"] <= k + 1 and set(s["per_epoch"]) == {"1", "2"}
        assert s["lookup_us_p50"] >= 0


@pytest.mark.parametrize("mode", ["history", "online"])
def test_replay_smoke(tmp_path, mode):
    out = tmp_path / "r.json"
    records = [r for r in read_trace(TRACE) if r.epoch <= 2]
    small = tmp_path / "small.jsonl"
    write_trace(str(small), records)
    assert replay.main(["--traces", str(small), "--k", "8", "--mode", mode, "--json", str(out),
                        "--sources", "rhyme,histospec,oracle"]) == 0
    result = json.loads(out.read_text())
    _check(result, ["rhyme", "histospec", "oracle"], 8, mode)
    assert result["sources"]["oracle"]["tau"] >= result["sources"]["histospec"]["tau"]


@pytest.mark.sglang
def test_replay_with_sglang_ngram():
    from benchmarks.peers import ngram
    why = ngram.import_error()
    if why:
        pytest.skip(f"sglang NgramCorpus not importable: {why}")
    records = [r for r in read_trace(TRACE) if r.epoch <= 1]
    result = replay.run(records, 8, "history", ["sglang-ngram", "sglang-ngram-tree"])
    for name in ("sglang-ngram", "sglang-ngram-tree"):
        assert 1.0 <= result["sources"][name]["tau"] <= 9
