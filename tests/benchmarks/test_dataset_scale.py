"""bench_rollout's dataset-scale run (benchmarks/dataset_scale.py): the step plan, the run-ahead
seeds and the report block, without an engine."""

import pytest

from benchmarks.bench_rollout import parse_args
from benchmarks.dataset_scale import run_ahead_seed, step_plan, summarize

IDS = [f"p{i}" for i in range(10)]


def test_every_prompt_once_per_epoch_in_steps_of_b():
    plan = step_plan(IDS, 4, 3, seed=7)
    assert [len(s["prompts"]) for s in plan] == [4, 4, 2] * 3
    for epoch in range(3):
        seen = [p for s in plan if s["epoch"] == epoch for p in s["prompts"]]
        assert sorted(seen) == sorted(IDS)
    assert [s["step"] for s in plan] == list(range(9))
    orders = [[p for s in plan if s["epoch"] == e for p in s["prompts"]] for e in range(3)]
    assert orders[0] != orders[1]  # a new shuffle each epoch
    assert step_plan(IDS, 4, 3, seed=7) == plan and step_plan(IDS, 4, 3, seed=8) != plan


def test_visits_and_updates_since_the_last_visit():
    plan = step_plan(IDS[:8], 4, 2, seed=0)
    assert [s["visit"] for s in plan] == ["first", "first", "revisit", "revisit"]
    last = {}
    for s in plan:
        if s["visit"] == "revisit":
            assert s["updates_since"] == pytest.approx(
                sum(s["step"] - last[p] for p in s["prompts"]) / len(s["prompts"]))
            assert 1 <= s["updates_since"] <= 3
        last.update((p, s["step"]) for p in s["prompts"])
    uneven = step_plan(IDS[:6], 4, 2, seed=0)  # steps of 4 and 2: every prompt seen in epoch 0
    assert [s["visit"] for s in uneven] == ["first", "first", "revisit", "revisit"]


@pytest.mark.parametrize("bad", [dict(per_step=0), dict(epochs=0), dict(prompt_ids=[])])
def test_plan_refuses_bad_sizes(bad):
    kwargs = dict(prompt_ids=IDS, per_step=4, epochs=1, seed=0)
    kwargs.update(bad)
    with pytest.raises(ValueError):
        step_plan(**kwargs)


def test_run_ahead_seeds_never_equal_a_real_samples_seed():
    from rl_driver.tasks import sampling_seed

    real = {sampling_seed(0, step, p, k) for step in range(6) for p in IDS for k in range(4)}
    ahead = {run_ahead_seed(0, step, p, k) for step in range(6) for p in IDS for k in range(4)}
    assert len(ahead) == 6 * 10 * 4 and not real & ahead
    assert run_ahead_seed(0, 1, "p0", 0) == run_ahead_seed(0, 1, "p0", 0)


def _rows(name, taus, **extra):
    return [dict({"step": k, "makespan_s": 10.0 / t, "tau": t, "load_s": 0.1}, **extra)
            for k, t in enumerate(taus)]


def test_summary_block_compares_modes_by_visit():
    plan = step_plan(IDS[:8], 4, 2, seed=0)  # steps: first, first, revisit, revisit
    per_mode = {
        "vanilla": _rows("vanilla", [1, 1, 1, 1]),
        "rhyme": _rows("rhyme", [1.1, 1.2, 2.0, 2.2], store_bytes=100),
        "rhyme_per_step": _rows("rhyme_per_step", [1.1, 1.2, 2.0, 2.0], store_bytes=40,
                                import_s=0.5, export_s=0.1),
        "rhyme_run_ahead": _rows("rhyme_run_ahead", [1.1, 1.6, 2.0, 2.0], store_bytes=50,
                                 import_s=0.5, export_s=0.1),
    }
    out = summarize(plan, per_mode, train_s=[0.2, 0.2, 0.2, 0.2], sim=None)
    block = out["dataset_scale"]
    assert block["revisit_tau"] == {"in_engine": pytest.approx(2.1), "per_step_load": 2.0}
    # first-visit steps with a step before them: step 1 only
    assert block["first_visit_tau"] == {"siblings_only": 1.2, "run_ahead": 1.6}
    assert block["engine_store_bytes_max"] == {"in_engine": 100, "per_step_load": 40}
    # 0.6 s of transfer against 0.3 s of train + load: 0.3 s on the critical path each step
    assert block["transfer_s_on_critical_path"] == pytest.approx(0.3)
    assert block["step_s_mean"] == pytest.approx(sum(10 / t + 0.3 for t in [1.1, 1.2, 2, 2]) / 4)
    assert block["speedup_vs_vanilla"]["revisit"]["rhyme"] == pytest.approx(2.1, rel=0.01)
    assert [r["visit"] for r in out["per_step"]] == ["first", "first", "revisit", "revisit"]
    assert out["per_step"][3]["rhyme_run_ahead"]["tau"] == 2.0


def test_dataset_flags_fill_their_own_defaults():
    args = parse_args(["--dataset-prompts", "64", "--prompts-per-step", "16"])
    assert (args.epochs, args.group, args.max_new_tokens, args.prompts) == (2, 4, 640, "64")
    assert "rhyme_run_ahead" in args.modes
    args = parse_args(["--dataset-prompts", "8", "--group", "2", "--epochs", "3"])
    assert (args.group, args.epochs) == (2, 3)


def test_trace_records_relabelled_by_pass():
    from benchmarks.dataset_scale import by_pass
    from rhyme_sglang.core.trace import TraceRecord

    plan = step_plan(IDS[:4], 2, 2, seed=0)
    records = [TraceRecord(prompt_id=p, epoch=s["step"], sample=0, prompt_token_ids=[1],
                           response_token_ids=[2], reward=0.0, finish_reason="stop")
               for s in plan for p in s["prompts"]]
    assert [r.epoch for r in by_pass(records, plan)] == [0, 0, 0, 0, 1, 1, 1, 1]
