"""Branch points, the reward-coefficient fit, the online reward rule and sibling rewards."""

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import BACKENDS
from rhyme_sglang.core import DraftStore, PySuffixTrie, StoreConfig
from rhyme_sglang.core.branching import HistoryIndex, RewardFit, branch_points

PROMPT = [50, 51, 52]
seqs = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=5)


def _brute_branches(hist, seq, j, max_match):
    """Longest match of seq[:j] (<= max_match) followed by a token in the history, and the
    continuation token -> history indices of those occurrences."""
    for m in range(min(max_match, j), 0, -1):
        pat = seq[j - m:j]
        out = {}
        for r, s in enumerate(hist):
            for i in range(m, len(s)):
                if s[i - m:i] == pat:
                    out.setdefault(s[i], []).append(r)
        if out:
            return out
    return {}


@settings(max_examples=150, deadline=None)
@given(hist=seqs, seq=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       max_match=st.integers(1, 5), start=st.integers(0, 4))
def test_branch_points_match_brute_force(hist, seq, max_match, start):
    got = {j: {t: sorted(r) for t, r in br.items()}
           for j, br in branch_points(HistoryIndex(hist), seq, start, max_match)}
    want = {}
    for j in range(start, len(seq)):
        br = _brute_branches(hist, seq, j, max_match)
        if len(br) > 1:
            want[j] = {t: sorted(r) for t, r in br.items()}
    assert got == want


def _synthetic_points(coef, n, rng):
    points = []
    for _ in range(n):
        branches = [np.array([[0.0, rng.uniform(-2, 2)] for _ in range(rng.randint(1, 3))])
                    for _ in range(2)]
        w = [np.exp(coef * b[:, 1]).sum() for b in branches]
        points.append((branches, 0 if rng.random() < w[0] / sum(w) else 1))
    return points


@pytest.mark.parametrize("coef", [0.0, 1.0, 2.0])
def test_reward_fit_recovers_the_generating_coefficient(coef):
    fit = RewardFit(initial=0.5, min_points=50)
    for branches, taken in _synthetic_points(coef, 3000, random.Random(0)):
        fit.observe(branches, taken)
    assert fit.close_epoch() == coef


def test_reward_fit_keeps_its_coefficient_without_evidence():
    fit = RewardFit(initial=0.5, min_points=20)
    for branches, taken in _synthetic_points(3.0, 10, random.Random(1)):
        fit.observe(branches, taken)
    assert fit.close_epoch() == 0.5 and fit.points == 10


def _epoch(s, epoch, branches, rewards):
    for sample, (tail, r) in enumerate(zip(branches, rewards)):
        s.add_response("p", PROMPT, [1, 2] + tail, epoch, r, sample)
    s.advance_epoch()


def _preferred(s):
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", [1, 2])
    tok = s.speculate("q", 1, max_branch=1).token_ids
    s.finish_request("q", add_to_history=False)
    return tok


@pytest.mark.parametrize("backend", BACKENDS)
def test_online_rule_learns_whether_the_policy_follows_high_advantage_branches(backend):
    """History: 12 low-reward responses continue with 7, 4 high-reward ones with 8. When every
    later response takes 8, the fitted coefficient grows until drafting prefers 8; when later
    responses take the branches in proportion to their counts, it stays at 0 or below."""
    cfg = dict(prompt_prefix=2, use_global=False, use_live=False, epoch_decay=1.0)
    first, rewards = [[7]] * 12 + [[8]] * 4, [0.0] * 12 + [1.0] * 4
    follow = DraftStore(StoreConfig(reward_rule="online", reward_weight=0.0, **cfg), backend)
    ignore = DraftStore(StoreConfig(reward_rule="online", reward_weight=0.0, **cfg), backend)
    for epoch in range(3):
        _epoch(follow, epoch, first if epoch == 0 else [[8]] * 16, rewards)
        _epoch(ignore, epoch, first, rewards)
        assert follow.check_integrity() and ignore.check_integrity()
    assert follow.reward_coef >= 1.0 and _preferred(follow) == [8]
    summary = follow.reward_summary()
    assert summary["rule"] == "online" and summary["coef"] == follow.reward_coef
    assert summary["points"] > 20 and max(summary["loglik"].values()) == summary["loglik"][f"{summary['coef']:g}"]
    assert ignore.reward_coef <= 0.0 and _preferred(ignore) == [7]
    w = {r.sample: r.weight for r in follow.records() if r.epoch == 0}
    assert w[15] > math.exp(follow.reward_coef) * w[0]   # epoch 0 re-weighted by the new coefficient


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["none", "finished"])
def test_sibling_rewards_weight_the_open_epoch(backend, rule):
    s = DraftStore(StoreConfig(prompt_prefix=2, use_global=False, use_live=False,
                               reward_weight=2.0, sibling_rewards=rule), backend)
    for sample, (tail, r) in enumerate([([7], 0.0), ([7], 0.0), ([8], 1.0)]):
        s.start_request(f"r{sample}", PROMPT, "p", sample)
        s.add_tokens(f"r{sample}", [1, 2] + tail)
        s.finish_request(f"r{sample}", reward=r)
    assert _preferred(s) == ([8] if rule == "finished" else [7])
    assert s.check_integrity()
    s.advance_epoch()
    assert _preferred(s) == [8] and s.check_integrity()   # the closed epoch is weighted either way


def test_prefer_ranks_the_preferred_path_first_and_changes_nothing_else():
    t = PySuffixTrie(8)
    for seq, w in (([1, 2, 3, 4], 10), ([1, 2, 5, 6], 3), ([1, 2, 5, 7], 2)):
        t.insert(seq, w)
    args = ([1, 2], 4, 3, 0.0, 1)
    assert t.draft(*args)[0] == [3, 4]
    toks, parents, probs, _, _ = t.draft(*args, prefer=[5, 7])
    plain = t.draft(*args, prefer=())
    assert toks == [5, 7] and parents == [-1, 0]
    assert probs[0] == pytest.approx(plain[2][0])          # the top rank's probability
    assert tuple(t.draft(*args, prefer=[9])) == tuple(plain)  # absent token: no change


@pytest.mark.parametrize("field, value", [("reward_rule", "bandit"), ("sibling_rewards", "all"),
                                          ("reward_fit_tokens", -1)])
def test_bad_reward_settings_raise(field, value):
    with pytest.raises(ValueError, match=field):
        StoreConfig(**{field: value})
