"""The replay benchmark runs on the dev trace and returns well-formed results."""

import json
from pathlib import Path

import pytest

from benchmarks import replay
from benchmarks.peers.oracle import OracleSource
from rhyme_sglang.core.trace import TraceRecord, read_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = str(ROOT / "benchmarks" / "data" / "traces_smollm2_arith_dev.jsonl.gz")  # committed


def _check(result, names, k, mode):
    assert result["k"] == k and result["mode"] == mode
    for name in names:
        s = result["sources"][name]
        assert set(s) == {"tau", "per_epoch", "waste", "lookup_us_p50", "per_prompt"}
        assert sum(t for t, _ in s["per_prompt"].values()) / sum(
            n for _, n in s["per_prompt"].values()) == pytest.approx(s["tau"])
        assert 1.0 <= s["tau"] <= k + 1 and set(s["per_epoch"]) == {"1", "2"}
        assert s["lookup_us_p50"] >= 0


@pytest.mark.parametrize("mode", ["history", "online"])
def test_replay_smoke(tmp_path, mode):
    out = tmp_path / "r.json"
    records = [r for r in read_trace(TRACE) if r.epoch <= 2]
    small = tmp_path / "small.jsonl"
    write_trace(str(small), records)
    assert replay.main(["--traces", str(small), "--k", "8", "--mode", mode, "--json", str(out),
                        "--sources", "rhyme,histospec,oracle,oracle-ext"]) == 0
    result = json.loads(out.read_text())
    _check(result, ["rhyme", "histospec", "oracle", "oracle-ext"], 8, mode)
    tau = {name: s["tau"] for name, s in result["sources"].items()}
    assert tau["oracle-ext"] >= tau["oracle"] >= tau["histospec"]
    assert tau["oracle-ext"] >= tau["rhyme"]
    r = result["ratios"]
    assert r["target_tau"] == pytest.approx(1.2 * tau["histospec"])
    assert r["target/oracle-ext"] == pytest.approx(r["target_tau"] / tau["oracle-ext"])


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


def _rec(epoch, prompt, response, sample=0):
    return TraceRecord("p", epoch, sample, prompt, response, 0.0, "stop")


@pytest.mark.parametrize("extended", [False, True])
def test_oracle_ceilings_by_hand(extended):
    """History holds 5 6 7; the new response copies 5 6 7 (history) and then 1 2 3 4 from its
    own prompt, so only the extended ceiling may draft the second part."""
    prompt, k = [1, 2, 3, 4, 9], 8
    hist = _rec(0, prompt, [5, 6, 7])
    new = _rec(1, prompt, [5, 6, 7, 1, 2, 3, 4])
    epochs = {0: [hist], 1: [new]}
    result = replay.replay_source(OracleSource(k, extended=extended), epochs, k, "history")
    # plain: step 1 drafts 5 6 7 (context 9), bonus 1, then 2 3 4 one per step: 7 tokens / 4 steps;
    # extended: after the bonus 1, "1 2 3 4" occurs in the prompt: 7 tokens / 2 steps
    assert result["tau"] == pytest.approx(7 / 2 if extended else 7 / 4)


def test_branch_analysis_and_rank_oracle(tmp_path):
    """The rank oracle only re-ranks siblings, so it never does worse than rhyme (and drafts like
    it when there is nothing to re-rank); the analysis finds branch points on the dev trace."""
    records = [r for r in read_trace(TRACE) if r.epoch <= 1 and r.prompt_id in _first_prompts(3)]
    small = tmp_path / "small.jsonl"
    write_trace(str(small), records)
    out = tmp_path / "b.json"
    assert replay.main(["--traces", str(small), "--k", "8", "--json", str(out), "--analyze-branches",
                        "--sources", "rhyme,rhyme-online,rhyme-w0.25,rhyme-rankoracle"]) == 0
    result = json.loads(out.read_text())
    tau = {name: s["tau"] for name, s in result["sources"].items()}
    rep = result["branches"]
    assert rep["tau"] == pytest.approx(tau["rhyme"])          # the analysis replays plain rhyme
    assert rep["tau_rank_oracle"] == pytest.approx(tau["rhyme-rankoracle"])
    assert tau["rhyme-rankoracle"] >= tau["rhyme"]
    assert 0 < rep["branch_points"] and rep["reference_takes_a_branch"] <= rep["branch_points"]
    assert rep["steps_with_branch_point"] <= rep["steps"]
    assert sum(c["n"] for c in rep["by_advantage_difference"].values()) == rep["reference_takes_a_branch"]
    assert rep["fit"]["best_coef"] in (-0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


def _first_prompts(n):
    return sorted({r.prompt_id for r in read_trace(TRACE)})[:n]


def test_decay_and_reward_variants_by_name():
    from benchmarks.replay import make_source

    assert make_source("rhyme-d0.9", 8).store.config.epoch_decay == 0.9
    assert make_source("rhyme-w0.25", 8).store.config.reward_weight == 0.25
    for bad in ("rhyme-dx", "rhyme-d0", "rhyme-d1.5"):
        with pytest.raises(ValueError):
            make_source(bad, 8)
