"""Group assignment (LPT vs round-robin, affinity), utilisation accounting, reward functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_driver.balance import assign_groups, imbalance, merge_intervals, utilisation
from rl_driver.rewards import extract_answer, reasoning_gym_reward, target_token_reward
from rl_driver.tasks import Prompt


def test_lpt_beats_round_robin_on_a_skewed_workload():
    # four long groups and many short ones; the long ones all land on engine 0 round-robin
    loads = [800, 20, 780, 25, 790, 20, 760, 25, 30, 10, 20, 30]
    groups = [f"g{i}" for i in range(len(loads))]
    load = dict(zip(groups, loads))
    lpt = assign_groups(groups, loads, 2, "lpt")
    rr = assign_groups(groups, loads, 2, "round_robin")
    assert sorted(g for eng in lpt for g in eng) == sorted(groups)
    assert imbalance(lpt, load) < imbalance(rr, load)
    assert imbalance(lpt, load) < 1.05 < 1.3 < imbalance(rr, load)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1000.0), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=4), st.floats(min_value=0.0, max_value=0.5))
def test_affinity_assignment_is_a_partition_within_lpt_bound(loads, n, tol):
    groups = list(range(len(loads)))
    previous = {g: g % n for g in groups}
    out = assign_groups(groups, loads, n, "lpt", previous=previous, tolerance=tol)
    assert sorted(g for eng in out for g in eng) == groups
    totals = [sum(loads[g] for g in eng) for eng in out]
    mean = sum(loads) / n
    # sticky placements stay under (1 + tol) * mean; LPT adds at most one group on top
    assert max(totals) <= (1 + tol) * mean + max(loads) + 1e-6


def test_affinity_keeps_groups_home_when_balanced():
    loads = [10.0, 10.0, 10.0, 10.0]
    out = assign_groups(["a", "b", "c", "d"], loads, 2, "lpt",
                        previous={"a": 1, "b": 1, "c": 0, "d": 0})
    assert sorted(out[1]) == ["a", "b"] and sorted(out[0]) == ["c", "d"]
    with pytest.raises(ValueError, match="policy"):
        assign_groups(["a"], [1.0], 1, "random")


def test_utilisation_and_bubble_ratio():
    assert merge_intervals([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    u = utilisation({0: [(0.0, 10.0)], 1: [(0.0, 4.0), (2.0, 5.0)]}, 2, 0.0, 10.0)
    assert u["engine_busy_s"] == [10.0, 5.0]
    assert u["bubble_ratio"] == pytest.approx(5.0 / 20.0)


def test_reward_functions():
    p = Prompt("p", [1, 2], {"target_token_id": 7})
    assert target_token_reward(p, "", [7, 7, 1, 2]) == 0.5
    q = Prompt("q", [1], {"target_token_id": -1, "target_modulus": 4})
    assert target_token_reward(q, "", [4, 8, 3, 5]) == 0.5 and target_token_reward(q, "", []) == 0.0
    assert extract_answer("so <answer> 7 </answer> then <answer>8</answer>") == "8"
    assert extract_answer("no tag") is None
    entry = {"dataset": "chain_sum", "size": 3, "seed": 1, "index": 0,
             "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "question": "4 - 1 =", "answer": "3", "metadata": {}}
    prompt = Prompt("c", [1], entry)
    assert reasoning_gym_reward(prompt, "4 - 1 = 3\n<answer>3</answer>", []) == pytest.approx(1.1)
    assert reasoning_gym_reward(prompt, "<answer>5</answer>", []) == pytest.approx(0.1)
    assert reasoning_gym_reward(prompt, "3", []) == 0.0
