"""The trace-driven rollout simulator: cost tables, multi-engine batching, modes, validation."""

import json

import pytest

from benchmarks import cost_tables as ct
from benchmarks import rollout_sim as rs
from benchmarks.ordering_sim import Migration, SimRequest, UnitStepper, simulate
from rhyme_sglang.core import TraceRecord, write_trace

FLAT_MS = {"widths": [1, 2, 4, 8], "calibration": 1.0,
           "seconds_per_request_step": {"1": {"0": 0.01, "8": 0.01}, "64": {"0": 0.01 / 64,
                                                                          "8": 0.01 / 64}}}


def _table(points):
    return {"format": "rhyme-step-cost/1", "kind": "measurement", "device": "test",
            "points": [dict(context=c, batch_size=b, width=w, tokens=b * (w + 1), seconds=s,
                            status="ok") for c, b, w, s in points]}


def test_step_cost_table_interpolates_batch_width_and_context():
    t = ct.StepCostTable(_table([(1000, 1, 0, 1.0), (1000, 3, 0, 2.0), (1000, 1, 4, 3.0),
                                 (1000, 3, 4, 5.0), (3000, 1, 0, 2.0), (3000, 3, 0, 3.0),
                                 (3000, 1, 4, 4.0), (3000, 3, 4, 6.0)]))
    assert t.seconds(1, 0, 1000) == pytest.approx(1.0)
    assert t.seconds(2, 0, 1000) == pytest.approx(1.5)  # between batches
    assert t.seconds(1, 2, 1000) == pytest.approx(2.0)  # between widths
    assert t.seconds(3, 4, 2000) == pytest.approx(5.5)  # between contexts
    assert t.seconds(1, 0, 500) == pytest.approx(1.0)  # below the smallest context: clamped
    assert t.seconds(5, 0, 1000) == pytest.approx(3.0)  # past the last batch: linear
    assert t.forward_seconds(15) == pytest.approx(5.0)  # tokens 15 = batch 3 x width 4
    assert t.forward_seconds(25) == pytest.approx(5.0 + (5.0 - 3.0) * (25 - 15) / (15 - 5))


def test_skipped_points_are_ignored_and_an_empty_table_is_refused():
    table = _table([(1000, 1, 0, 1.0)])
    table["points"].append(dict(context=1000, batch_size=2, width=0, tokens=2, seconds=None,
                                status="skipped: out of memory"))
    assert ct.StepCostTable(table).seconds(2, 0, 1000) == pytest.approx(1.0)
    table["points"] = table["points"][1:]
    with pytest.raises(ValueError, match="no measured points"):
        ct.StepCostTable(table)


def test_cost_model_table_reads_seconds_per_request_step():
    t = ct.CostModelTable(FLAT_MS)
    assert t.seconds(1, 0, 0) == pytest.approx(0.01)
    assert t.seconds(64, 8, 0) == pytest.approx(0.01)


def test_migration_moves_an_overrunning_request_to_the_idle_engine():
    def reqs():
        return [[SimRequest("a", "a", 10, predicted=2.0), SimRequest("b", "b", 10, predicted=2.0)],
                [SimRequest("c", "c", 1, predicted=1.0)]]

    step = UnitStepper(lambda b: 1.0)  # every step costs 1 s whatever the batch
    stay = simulate(reqs(), 4, step)
    moved = simulate(reqs(), 4, step, migration=Migration(overrun_factor=1.5, min_remaining_tokens=1))
    assert stay["makespan_s"] == 10.0 and stay["migrations"] == 0
    assert moved["migrations"] == 1 and moved["makespan_s"] == 10.0  # both still run in parallel
    # with one slot per engine the move halves the queueing of engine 0
    one_slot_stay = simulate(reqs(), 1, step)["makespan_s"]
    one_slot_moved = simulate(reqs(), 1, step, migration=Migration(min_remaining_tokens=1))["makespan_s"]
    assert one_slot_stay == 20.0 and one_slot_moved == 14.0  # a moves at t=4, b starts then


def _trace(tmp_path, epochs=3, length=40):
    """Two prompts x 2 samples; every epoch repeats the same responses (full reuse)."""
    recs = []
    for e in range(epochs):
        for p in range(2):
            for s in range(2):
                resp = [100 + p * 50 + (7 * i + s) % 23 for i in range(length + 10 * p)]
                recs.append(TraceRecord(f"p{p}", e, s, [1, 2, 3, 4 + p], resp, 1.0, "stop"))
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), recs)
    return path, recs


def test_history_drafting_beats_vanilla_on_a_repeating_trace(tmp_path):
    _, recs = _trace(tmp_path)
    table = ct.CostModelTable(FLAT_MS)
    cfg = rs.SimConfig(k=8, max_running=8, prefill=False, engines=1)
    out = rs.run(recs, lambda m: table, cfg, ["vanilla", "rhymerl", "rhyme", "rhyme_fixed"],
                 backend="python")
    van = out["modes"]["vanilla"]
    # vanilla: one token per step, flat 0.01 s steps: makespan = longest response's steps
    assert van["per_epoch"]["1"]["makespan_s"] == pytest.approx(50 * 0.01)
    assert van["makespan_s"] == pytest.approx(2 * 50 * 0.01)  # epochs 1 and 2 (0 builds history)
    for m in ("rhymerl", "rhyme", "rhyme_fixed"):
        assert out["speedup_vs_vanilla"][m] > 1.5, (m, out["modes"][m]["per_epoch"])
        assert out["modes"][m]["per_epoch"]["2"]["tau"] > 2.0
    assert out["modes"]["rhyme"]["cost_model"]["widths"] == [1, 2, 4, 8]


def test_copies_use_disjoint_alphabets_and_two_engines_balance(tmp_path):
    _, recs = _trace(tmp_path, epochs=2)
    scaled = rs.scale_records(recs, 3)
    assert len(scaled) == 3 * len(recs)
    assert len({r.prompt_id for r in scaled}) == 6
    alph = [set(t for r in scaled if r.prompt_id.endswith(sfx) for t in r.response_token_ids)
            for sfx in ("p0", "~1", "~2")]
    assert not alph[0] & alph[1] and not alph[1] & alph[2]
    table = ct.CostModelTable(FLAT_MS)
    one = rs.run_mode("vanilla", scaled, table, rs.SimConfig(max_running=4, prefill=False))
    two = rs.run_mode("vanilla", scaled, table, rs.SimConfig(max_running=4, engines=2,
                                                                prefill=False))
    assert two["makespan_s"] < one["makespan_s"]


def test_length_scale_multiplies_vanilla_time(tmp_path):
    _, recs = _trace(tmp_path, epochs=2)
    table = ct.CostModelTable(FLAT_MS)
    base = rs.run_mode("vanilla", recs, table, rs.SimConfig(prefill=False))
    x4 = rs.run_mode("vanilla", recs, table, rs.SimConfig(prefill=False, length_scale=4))
    assert x4["makespan_s"] == pytest.approx(4 * base["makespan_s"])


def test_validate_reports_the_relative_error_per_mode(tmp_path):
    path, _ = _trace(tmp_path)
    bench = {"config": {"max_running_requests": 8, "num_engines": 1, "num_draft_tokens": 9},
             "modes": {"vanilla": {"trace": path.name, "cost_model": FLAT_MS,
                                   "epochs": {"1": {"makespan_s": 0.55}, "2": {"makespan_s": 0.5}}}}}
    got = rs.validate(bench, str(tmp_path), rs.SimConfig(prefill=False))
    v = got["per_mode"]["vanilla"]
    assert v["simulated_s"] == pytest.approx(1.0) and v["measured_s"] == pytest.approx(1.05)
    assert got["max_rel_error"] == pytest.approx(0.05 / 1.05)
    # bench_rollout's own layout: per_epoch lists, the rhyme mode's cost model for vanilla
    laid_out = {"config": bench["config"],
                "modes": {"vanilla": {"trace": path.name},
                          "rhyme": {"trace": path.name, "rhyme_stats": {"cost_model": FLAT_MS}}},
                "per_epoch": {"vanilla": [{"epoch": 1, "makespan_s": 0.55},
                                          {"epoch": 2, "makespan_s": 0.5}],
                              "rhyme": [{"epoch": 1, "makespan_s": 0.3}]}}
    again = rs.validate(laid_out, str(tmp_path), rs.SimConfig(prefill=False))
    assert again["per_mode"]["vanilla"]["rel_error"] == pytest.approx(0.05 / 1.05)
    assert set(again["per_mode"]) == {"vanilla", "rhyme"}
    del bench["modes"]["vanilla"]["cost_model"]
    with pytest.raises(ValueError, match="cost_model"):
        rs.validate(bench, str(tmp_path), rs.SimConfig())


def test_cli_writes_the_issue_json(tmp_path):
    path, _ = _trace(tmp_path, epochs=2)
    table = tmp_path / "table.json"
    table.write_text(json.dumps(_table([(64, 1, 0, 0.01), (64, 8, 0, 0.012), (64, 1, 8, 0.011),
                                        (64, 8, 8, 0.02)])))
    out = tmp_path / "sim.json"
    assert rs.main(["--traces", str(path), "--cost-table", str(table), "--json", str(out),
                    "--modes", "vanilla,rhyme", "--backend", "python"]) == 0
    got = json.loads(out.read_text())
    assert set(got) >= {"cost_table", "modes", "speedup_vs_vanilla", "validation"}
    assert set(got["modes"]) == {"vanilla", "rhyme"}
    assert got["modes"]["vanilla"]["per_epoch"]["1"]["makespan_s"] > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="assign"):
        rs.SimConfig(assign="random")
    with pytest.raises(ValueError, match="copies"):
        rs.scale_records([], 0)
    with pytest.raises(ValueError, match="unknown mode"):
        rs.run([], lambda m: None, rs.SimConfig(), ["eagle"])


def test_timeline_table_charges_each_mode_its_measured_steps():
    timeline = [[0.0, "prefill", 4, 1.0, 100], [1.0, "prefill", 4, 3.0, 300],
                [2.0, "plain", 2, 0.2, 2], [2.2, "plain", 2, 0.4, 2], [2.6, "plain", 4, 0.5, 4],
                [3.1, "verify_w4", 2, 0.9, 5]]
    t = ct.TimelineTable([timeline])
    assert t.seconds(2, 0, 0) == pytest.approx(0.3)  # mean of the bs-2 plain steps
    assert t.seconds(3, 0, 0) == pytest.approx(0.4)  # between batch sizes
    assert t.seconds(2, 2, 0) == pytest.approx(0.6)  # between plain and width 4
    assert t.forward_seconds(200) == pytest.approx(2.0)  # prefill line: 0.01 s per token
    with pytest.raises(ValueError, match="no decode steps"):
        ct.TimelineTable([[[0.0, "prefill", 1, 1.0, 10]]])


def test_validate_uses_timelines_per_mode_draft_tokens_and_shared_history(tmp_path):
    path, recs = _trace(tmp_path)
    own = tmp_path / "own.jsonl"  # a timed mode's trace: only its timed epoch
    write_trace(str(own), [r for r in recs if r.epoch == 2])
    steps = [[0.0, "plain", b, 0.01, b] for b in (1, 2, 4)] + \
        [[0.0, "verify_w8", b, 0.01, b] for b in (1, 2, 4)]
    bench = {"config": {"max_running_requests": 8, "num_draft_tokens": {"vanilla": None, "rhyme_fixed": 9}},
             "modes": {"vanilla": {"trace": path.name}, "rhyme_fixed": {"trace": own.name}},
             "per_epoch": {"vanilla": [{"epoch": 1, "makespan_s": 0.5}, {"epoch": 2, "makespan_s": 0.5}],
                           "rhyme_fixed": [{"epoch": 2, "makespan_s": 0.1}]},
             "breakdown": {"vanilla": [{"epoch": 1, "timeline": steps}],
                           "rhyme_fixed": [{"epoch": 2, "timeline": steps}]}}
    got = rs.validate(bench, str(tmp_path), rs.SimConfig(prefill=False))
    assert got["per_mode"]["vanilla"]["simulated_s"] == pytest.approx(1.0)
    fixed = got["per_mode"]["rhyme_fixed"]["per_epoch"]["2"]
    # vanilla's epochs 0-1 gave rhyme_fixed its history: repeated responses are drafted
    assert fixed["simulated_tau"] > 2.0 and fixed["simulated_s"] < 0.5


def _req(group, prompt, done=0):
    rec = TraceRecord(group, 1, 0, list(prompt), [1, 2, 3], 0.0, "stop")
    return SimRequest(f"{group}/{len(prompt)}/{done}", group, 3, 0.0, len(prompt), rec, done)


def test_prefix_cache_charges_uncached_prompt_tokens_per_pass():
    shared = list(range(100, 150))  # a few-shot prefix both prompts share
    a, b = shared + [1, 2, 3, 4], shared + [5, 6]
    # one pass, no group prefill: all four prefill in full (nothing is cached within a pass)
    assert rs.PrefixCache().admit([_req("a", a), _req("a", a), _req("b", b), _req("b", b)],
                                  False) == 2 * len(a) + 2 * len(b)
    # with group prefill, the siblings of a leader in the pass are charged their last token
    assert rs.PrefixCache().admit([_req("a", a), _req("a", a), _req("b", b), _req("b", b)],
                                  True) == len(a) + len(b) + 2
    cache = rs.PrefixCache()
    assert cache.admit([_req("a", a)], False) == len(a)
    # a later pass hits what earlier passes cached: the shared prefix, then the whole prompt
    assert cache.admit([_req("b", b)], False) == len(b) - len(shared)
    assert cache.admit([_req("a", a)], False) == 1
    # a migrated request re-prefills its generated tokens on the new engine
    assert cache.admit([_req("a", a, done=7)], False, length_scale=2) == 1 + 14


def test_rhyme_modes_model_group_prefill():
    assert rs.MODES["rhyme"].group_prefill and rs.MODES["rhyme_fixed"].group_prefill
    assert not any(rs.MODES[m].group_prefill for m in ("vanilla", "ngram", "rhymerl", "suffix"))
