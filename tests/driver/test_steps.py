"""The step sampler (rl_driver/steps.py): seeded per-epoch shuffles, every prompt once per
epoch, steps of B prompts (the last smaller), and the revisit bookkeeping."""

from __future__ import annotations

import pytest

from rl_driver.steps import StepSampler

IDS = [f"p{i}" for i in range(10)]


def test_deterministic_per_seed_and_each_prompt_once_per_epoch():
    a, b = StepSampler(IDS, 4, seed=7), StepSampler(IDS, 4, seed=7)
    assert a.steps_per_epoch == 3
    for s in range(9):
        assert a.step(s) == b.step(s)
    for epoch in range(3):
        steps = [a.step(epoch * 3 + k) for k in range(3)]
        assert [len(st.prompt_ids) for st in steps] == [4, 4, 2]  # the last step is smaller
        assert all(st.epoch == epoch for st in steps)
        assert [st.step_in_epoch for st in steps] == [0, 1, 2]
        assert sorted(p for st in steps for p in st.prompt_ids) == sorted(IDS)
    assert a.order(0) != a.order(1)  # a new shuffle every epoch
    assert StepSampler(IDS, 4, seed=8).order(0) != a.order(0)


def test_zero_or_all_is_one_step_per_epoch_in_dataset_order():
    for per_step in (0, len(IDS)):
        sampler = StepSampler(IDS, per_step, seed=3)
        assert sampler.steps_per_epoch == 1 and not sampler.shuffle
        assert [sampler.step(s) for s in range(2)] == [(0, 0, 0, IDS), (1, 1, 0, IDS)]
        assert sampler.visit(0).kind == "first"
        assert sampler.visit(1).kind == "revisit" and set(sampler.visit(1).updates.values()) == {1}


def test_visits_and_updates_since_last_visit():
    sampler = StepSampler([f"p{i}" for i in range(6)], 3, seed=0)
    kinds = [sampler.visit(s).kind for s in range(6)]
    assert kinds == ["first", "first", "revisit", "revisit", "revisit", "revisit"]
    for s in range(2, 6):
        for pid, n in sampler.visit(s).updates.items():
            assert sampler.step(s - n).prompt_ids.count(pid) == 1
            assert all(pid not in sampler.step(t).prompt_ids for t in range(s - n + 1, s))
    summary = sampler.visit(0).summary()
    assert summary == {"visit": "first", "updates_since_last_visit": None,
                       "updates_since_last_visit_min": None, "updates_since_last_visit_max": None}
    # 4 prompts, 3 a step: the second step holds 1 new prompt and, after the reshuffle, ...
    small = StepSampler(["a", "b", "c", "d"], 3, seed=1)
    assert small.steps_per_epoch == 2
    assert small.visit(1).kind == "first"
    kinds = {small.visit(s).kind for s in range(2, 8)}
    assert kinds <= {"revisit", "mixed"}
    for s in range(2, 8):
        v = small.visit(s)
        assert 1 <= min(v.updates.values()) <= max(v.updates.values()) <= 3
        s_ = v.summary()
        assert s_["updates_since_last_visit_min"] <= s_["updates_since_last_visit"] \
            <= s_["updates_since_last_visit_max"]


@pytest.mark.parametrize("args, needle", [
    (([], 1, 0), "at least one prompt"), ((["a", "a"], 1, 0), "unique"),
    ((["a"], -1, 0), "-1"), ((["a"], 1.5, 0), "1.5"), ((["a"], True, 0), "True")])
def test_bad_input(args, needle):
    with pytest.raises(ValueError, match=needle):
        StepSampler(*args)


def test_bad_step_and_epoch():
    sampler = StepSampler(IDS, 4, seed=0)
    with pytest.raises(ValueError, match="-1"):
        sampler.step(-1)
    with pytest.raises(ValueError, match="-2"):
        sampler.order(-2)
    with pytest.raises(ValueError, match="zz"):
        sampler.step_of("zz", 0)


def test_run_ahead_targets_and_seeds():
    """Run-ahead (rl_driver/dispatch.py): an idle engine drafts the next-step prompts planned
    on it, else half of the unclaimed others; each prompt once; its seeds are no real
    sample's."""
    from rl_driver.dispatch import RunAhead, job_params, run_ahead_seed

    ahead = RunAhead(preferred=[["a", "b"], ["c"]], prompt_ids={p: [1] for p in "abcd"},
                     samples=2, step=3, seed=0, max_new_tokens=8)
    assert ahead.take(1) == ["c"]
    assert ahead.take(1) == ["a", "b"]  # its own are claimed: half of the rest, rounded up
    assert ahead.take(0) == ["d"] and ahead.take(0) == []
    assert ahead.claimed == {"c": 1, "a": 1, "b": 1, "d": 0}
    real = {job_params({"sampling_seed": 0}, p, k, s)["sampling_seed"]
            for p in "abcd" for k in range(2) for s in range(5)}
    assert not real & {run_ahead_seed(0, s, p, k) for p in "abcd" for k in range(2) for s in range(5)}
    # epoch defaults to 0 (what Dispatcher used before); each global step draws new seeds
    assert job_params({"sampling_seed": 0}, "a", 1) == job_params({"sampling_seed": 0}, "a", 1, 0)
    assert job_params({"sampling_seed": 0}, "a", 1, 2) != job_params({"sampling_seed": 0}, "a", 1, 0)


def test_merge_histories_keeps_the_home_record():
    from rl_driver.phases import merge_histories

    home = {"prompt_id": "x", "records": [{"epoch": 0, "sample": 0, "response": [1]}]}
    other = {"prompt_id": "x", "records": [{"epoch": 0, "sample": 0, "response": [2]},
                                           {"epoch": 0, "sample": 0, "response": [3], "run_ahead": True}]}
    merged = merge_histories([home, other, {"prompt_id": "y", "records": []}])
    assert merged[0]["records"] == [{"epoch": 0, "sample": 0, "response": [1]},
                                    {"epoch": 0, "sample": 0, "response": [3], "run_ahead": True}]
    assert home["records"] == [{"epoch": 0, "sample": 0, "response": [1]}]  # inputs unchanged
    assert [m["prompt_id"] for m in merged] == ["x", "y"]


@pytest.mark.parametrize("raw, message", [
    ({"rollout": {"prompts_per_step": -1}}, "'rollout.prompts_per_step'.*-1"),
    ({"rollout": {"prompts_per_step": 9}, "task": {"num_prompts": 8}},
     "'rollout.prompts_per_step'.*9"),
    ({"rollout": {"history": "disk"}}, "'rollout.history'.*disk"),
    ({"rollout": {"history_shards": 0}}, "'rollout.history_shards'.*0"),
    ({"rollout": {"run_ahead": "yes"}}, "'rollout.run_ahead'.*yes"),
    ({"rollout": {"run_ahead_samples": 0}}, "'rollout.run_ahead_samples'.*0"),
    ({"rollout": {"run_ahead": True}, "engine": {"rhyme": False}}, "'rollout.run_ahead'.*True"),
    ({"rollout": {"history": "per_step"}, "engine": {"rhyme": False}},
     "'rollout.history'.*per_step"),
])
def test_step_config_keys_are_checked(raw, message):
    from rl_driver.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_step_config_defaults_are_todays_loop():
    from rl_driver.config import config_from_dict

    rollout = config_from_dict({}).rollout
    assert (rollout.prompts_per_step, rollout.history, rollout.run_ahead) == (0, "in_engine", False)
    cfg = config_from_dict({"rollout": {"prompts_per_step": 3, "history": "per_step",
                                        "run_ahead": True, "run_ahead_samples": 1}})
    assert cfg.rollout.prompts_per_step == 3 and cfg.rollout.run_ahead_samples == 1


def test_run_dir_state_keeps_the_step_size(tmp_path):
    """A fresh run drops the last run's driver history; a resume keeps the step size."""
    from rl_driver.config import ConfigError
    from rl_driver.metrics import RunState, open_run_dir

    run = tmp_path / "r"
    state = open_run_dir(run, {"rollout": {"prompts_per_step": 3}}, resume=False)
    state.next_step, state.next_epoch = 3, 1
    state.save(run)
    (run / "history").mkdir()
    (run / "history" / "shard-000.pkl").write_bytes(b"old")
    again = open_run_dir(run, {"rollout": {"prompts_per_step": 3}}, resume=True)
    assert (again.next_step, again.next_epoch, again.first_epoch_of_process) == (3, 1, 3)
    assert (run / "history" / "shard-000.pkl").exists()
    with pytest.raises(ConfigError, match="'rollout.prompts_per_step'.*4"):
        open_run_dir(run, {"rollout": {"prompts_per_step": 4}}, resume=True)
    open_run_dir(run, {"rollout": {"prompts_per_step": 4}}, resume=False)
    assert not (run / "history").exists() and not (run / "state.json").exists()
    old = run / "state.json"  # a state written before steps existed resumes at its epoch
    old.write_text('{"next_epoch": 2, "weight_version": 2, "affinity": {}}')
    assert RunState.load(run).next_step == 2
