"""First-visit steps with and without run-ahead (benchmarks.first_visit_sim)."""

import json
import os
import random

import pytest

from benchmarks import cost_tables as ct
from benchmarks import first_visit_sim as fv
from benchmarks.rollout_sim import SimConfig
from rhyme_sglang.core import StoreConfig, TraceRecord

DEV = os.path.join(os.path.dirname(fv.__file__), "data", "traces_smollm2_arith_dev.jsonl.gz")


def _flat_table(seconds_per_step=0.01):
    """Every step costs the same whatever batch, width and context; forwards likewise."""
    pts = [dict(context=1000, batch_size=b, width=w, tokens=b * (w + 1), seconds=seconds_per_step,
                status="ok") for b in (1, 256) for w in (0, 8)]
    return ct.StepCostTable({"format": "rhyme-step-cost/1", "kind": "measurement",
                             "device": "flat", "points": pts})


def _trace(epochs=2, prompts=2, samples=4, length=60):
    """Every sample its own random response (siblings share little); every epoch repeats epoch
    0's responses exactly."""
    rng = random.Random(7)
    base = {(p, s): [rng.randrange(100, 5000) for _ in range(length + 20 * p)]
            for p in range(prompts) for s in range(samples)}
    return [TraceRecord(f"p{p}", e, s, [1, 2, 3, 4 + p], base[p, s], 1.0, "stop")
            for e in range(epochs) for p in range(prompts) for s in range(samples)]


CFG = SimConfig(engines=2, max_running=8)


def test_identical_previous_epoch_raises_tau_and_speed_above_siblings_only():
    half = fv.first_visit_speedup(_trace(), _flat_table(), CFG, run_ahead_samples=2,
                                  run_ahead_fraction=1.0, epochs=[1])
    assert half["per_epoch"]["1"]["source_epoch"] == 0
    assert half["per_epoch"]["1"]["run_ahead_records"] == 4  # 2 prompts x 2 samples
    assert half["tau"]["rhyme_run_ahead"] > half["tau"]["rhyme"] + 0.2
    # every sample drafted: the undrafted ones no longer bound the step
    out = fv.first_visit_speedup(_trace(), _flat_table(), CFG, run_ahead_samples=4,
                                 run_ahead_fraction=1.0, epochs=[1])
    assert out["tau"]["rhyme_run_ahead"] > half["tau"]["rhyme_run_ahead"]
    assert out["rhyme_run_ahead_s"] < 0.5 * out["rhyme_s"]
    assert out["rhyme_run_ahead"] == pytest.approx(out["vanilla_s"] / out["rhyme_run_ahead_s"])
    assert out["rhyme"] == pytest.approx(out["vanilla_s"] / out["rhyme_s"])


def test_an_empty_run_ahead_fraction_gives_the_siblings_only_result():
    out = fv.first_visit_speedup(_trace(), _flat_table(), CFG, run_ahead_fraction=0.0, epochs=[1])
    assert out["per_epoch"]["1"]["run_ahead_records"] == 0
    assert out["rhyme_run_ahead_s"] == out["rhyme_s"]
    assert out["tau"]["rhyme_run_ahead"] == out["tau"]["rhyme"]


@pytest.mark.parametrize("min_tokens", [1, None, 10**6])
def test_a_truncated_run_ahead_keeps_the_floor_of_the_fraction(min_tokens):
    """... and, as the engine does, only records of at least the minimum length."""
    recs = _trace()
    out = fv.first_visit_speedup(recs, _flat_table(), CFG, run_ahead_samples=1,
                                 run_ahead_fraction=0.25, run_ahead_min_tokens=min_tokens,
                                 epochs=[1])
    least = StoreConfig().run_ahead_min_tokens if min_tokens is None else min_tokens
    kept = [n for r in recs if r.epoch == 0 and r.sample == 0
            if (n := int(0.25 * len(r.response_token_ids))) >= least]
    assert len(kept) == (2 if least <= 15 else 0)  # 15 and 20 tokens: both or neither
    assert out["per_epoch"]["1"]["run_ahead_record_tokens"] == sum(kept)
    assert out["per_epoch"]["1"]["run_ahead_records"] == len(kept)
    assert out["assumptions"]["run_ahead_min_tokens"] == least


def test_whole_run_ahead_responses_are_kept_at_any_length():
    recs = _trace(length=12)  # 12- and 32-token responses, kept whole (fraction 1)
    out = fv.first_visit_speedup(recs, _flat_table(), CFG, run_ahead_samples=1,
                                 run_ahead_fraction=1.0, run_ahead_min_tokens=40, epochs=[1])
    assert out["per_epoch"]["1"]["run_ahead_records"] == 2
    assert out["per_epoch"]["1"]["run_ahead_record_tokens"] == 12 + 32


def test_source_epochs_follow_the_rules():
    assert fv.source_epoch(3, [0, 1, 2, 3], "previous_epoch") == 2
    assert fv.source_epoch(0, [0, 1], "previous_epoch") == 1  # epoch 0 has no previous epoch
    assert fv.source_epoch(1, [0, 1, 2], "next_epoch") == 2
    assert fv.source_epoch(1, [0, 1], "same_epoch") == 1
    with pytest.raises(ValueError, match="lacks"):
        fv.source_epoch(1, [0, 1], "next_epoch")
    with pytest.raises(ValueError, match="run_ahead_source"):
        fv.source_epoch(1, [0, 1], "later")


def test_the_derived_fraction_matches_a_hand_computation():
    recs = _trace(samples=2)
    step = [r for r in recs if r.epoch == 1]
    ahead = fv.run_ahead_responses(step, [r for r in recs if r.epoch == 0], 2)
    # 2 engines: makespan 10 s, engine 0 busy 9 s + 1 s prefill (no idle), engine 1 busy 3 s +
    # 1 s prefill (6 s idle); 4 run-ahead requests -> 2 per engine; each step 0.01 s -> 200 tok/s
    vanilla = {"makespan_s": 10.0, "engine_busy_s": [9.0, 3.0], "engine_prefill_s": [1.0, 1.0]}
    got = fv.derive_fraction(vanilla, ahead, step, _flat_table(), CFG)
    needed = 60 + 60 + 80 + 80
    assert got["idle_engine_s"] == pytest.approx(6.0)
    assert got["batch_per_engine"] == 2
    assert got["decode_tokens_per_s_per_engine"] == pytest.approx(200.0)
    assert got["needed_tokens"] == needed
    assert got["fraction"] == pytest.approx(min(1.0, 6.0 * 200.0 / needed))
    slow = fv.derive_fraction(vanilla, ahead, step, _flat_table(1.0), CFG)
    assert slow["fraction"] == pytest.approx(6.0 * 2.0 / needed)  # 2 tok/s per engine


def test_the_cli_on_the_dev_trace_writes_the_documented_shape(tmp_path, capsys):
    out_path = tmp_path / "fv.json"
    assert fv.main([DEV, "--epochs", "1", "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert {"vanilla_s", "rhyme_s", "rhyme_run_ahead_s", "rhyme", "rhyme_run_ahead", "tau",
            "assumptions"} <= set(out)
    assert set(out["tau"]) == {"rhyme", "rhyme_run_ahead"}
    assert out["assumptions"]["cost_table"].startswith("cost_h200_qwen2-7b.json")
    assert out["assumptions"]["config"]["engines"] == 8
    assert 0.0 <= out["per_epoch"]["1"]["fraction"] <= 1.0
    assert capsys.readouterr().out.startswith("first_visit_sim traces_smollm2_arith_dev")
