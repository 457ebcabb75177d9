"""DraftStore lifecycle, weighting, history window, eviction and misuse."""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import BACKENDS, occurs_after, tokens
from rhyme_sglang.core import DraftStore, StoreConfig, WindowConfig

PROMPT = [50, 51, 52]


def store(backend="python", **kw):
    kw.setdefault("prompt_prefix", 2)
    return DraftStore(StoreConfig(**kw), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lifecycle_and_siblings_feed_each_other(backend):
    s = store(backend)
    s.start_request("a", PROMPT, "p", 0)
    s.start_request("b", PROMPT, "p", 1)
    s.add_tokens("a", [1, 2, 3, 4, 5])
    s.add_tokens("b", [1, 2])
    d = s.speculate("b", 4)
    assert d.token_ids[:3] == [3, 4, 5] and d.source.startswith("live")
    rec = s.finish_request("a", reward=1.0)
    assert rec.sample == 0 and list(rec.seq) == PROMPT[-2:] + [1, 2, 3, 4, 5]
    assert s.num_responses == 1 and s.check_integrity()
    s.finish_request("b")
    s.set_reward("b", 0.5)
    s.set_reward(("p", 0), 0.0)
    s.advance_epoch()
    s.start_request("c", PROMPT, "p")
    d = s.speculate("c", 8)
    assert d.token_ids[:5] == [1, 2, 3, 4, 5] and d.check_integrity()
    assert s.check_integrity()


def _branch_store(reward_weight, rewards):
    s = store(reward_weight=reward_weight, use_global=False, use_live=False)
    for sample, (branch, r) in enumerate(zip([[1, 2, 7, 7], [1, 2, 7, 7], [1, 2, 8, 8]], rewards)):
        s.add_response("p", PROMPT, branch, 0, r, sample)
    s.advance_epoch()
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", [1, 2])
    return s.speculate("q", 1, max_branch=1)


def test_reward_weighting_changes_the_preferred_branch():
    # counts alone prefer 7 (2 of 3); with a high-advantage lone 8-branch, 8 wins
    assert _branch_store(0.0, [0.0, 0.0, 1.0]).token_ids == [7]
    assert _branch_store(2.0, [0.0, 0.0, 1.0]).token_ids == [8]
    # and low-reward branches are never excluded from a wider tree
    s = _branch_store(2.0, [0.0, 0.0, 1.0])
    assert s.probs[0] < 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(group=st.lists(st.tuples(st.booleans(), st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.1])),
                      min_size=2, max_size=8),
       reward_weight=st.sampled_from([0.0, 0.5, 2.0]))
def test_preferred_branch_follows_the_reward_weights(backend, group, reward_weight):
    """Any group of responses splitting into branch 7 or 8 after a shared prefix: the single-branch
    draft takes the branch with the larger sum of exp(reward_weight * clipped group advantage)
    (ties: the smaller token), and a two-branch draft keeps every branch present."""
    from rhyme_sglang.core import weights as W

    s = store(backend, reward_weight=reward_weight, use_global=False, use_live=False)
    for sample, (is_seven, reward) in enumerate(group):
        s.add_response("p", PROMPT, [1, 2, 7 if is_seven else 8, 9], 0, reward, sample)
    s.advance_epoch()
    adv = W.group_advantages({i: r for i, (_, r) in enumerate(group)})
    total = {7: 0, 8: 0}
    for i, (is_seven, _) in enumerate(group):
        factor = W.reward_factor(adv[i], reward_weight, s.config.advantage_clip)
        total[7 if is_seven else 8] += W.response_weight(factor, 0, 0, s.config.epoch_decay)
    expected = 7 if total[7] >= total[8] else 8
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", [1, 2])
    assert s.speculate("q", 1, max_branch=1).token_ids == [expected]
    wide = s.speculate("q", 4, max_branch=2)  # room for both two-token branches
    present = {t for t in (7, 8) if total[t] > 0}
    roots = {t for t, parent in zip(wide.token_ids, wide.parents) if parent == -1}
    assert roots == present and all(p > 0 for p in wide.probs)


def test_recency_prefers_newer_epochs_and_latest_only_forgets():
    s = store(epoch_decay=0.5, use_global=False, use_live=False, reward_weight=0.0)
    for sample in range(3):
        s.add_response("p", PROMPT, [1, 7], 0, None, sample)
    s.advance_epoch()
    s.add_response("p", PROMPT, [1, 8], 1, None, 0)
    s.add_response("p", PROMPT, [1, 8], 1, None, 1)
    s.advance_epoch()
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", [1])
    assert s.speculate("q", 1).token_ids == [8]  # 2 newer (x2 each) outweigh 3 older
    latest = store(history_epochs=1, use_live=False)
    latest.add_response("p", PROMPT, [1, 7], 0)
    latest.advance_epoch()
    latest.add_response("p", PROMPT, [1, 8], 1)
    latest.advance_epoch()
    assert {r.epoch for r in latest.records()} == {1} and latest.check_integrity()


def test_global_trie_gets_open_epoch_responses_only_at_epoch_end():
    s = store(use_live=False)
    s.add_response("other", [1, 1, 1], [5, 6, 7, 8], 0)
    s.start_request("q", [2, 2, 2], "p")
    s.add_tokens("q", [5, 6])
    assert s.speculate("q", 2).token_ids == []
    s.advance_epoch()
    assert s.speculate("q", 2).token_ids == [7, 8]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(resp=st.lists(st.tuples(st.integers(0, 3), tokens), min_size=1, max_size=30),
       budget=st.integers(2000, 20000))
def test_eviction_respects_the_budget(backend, resp, budget):
    s = store(backend, memory_budget=budget)
    for i, (p, seq) in enumerate(resp):
        s.add_response(f"p{p}", [p, p], seq, i // 5)
        assert s.history_bytes() <= budget or s.num_responses == 0
        assert s.check_integrity()


def test_eviction_order_lru_prompt_then_oldest_epoch():
    def fill(s):
        s.add_response("a", [1], [1, 2, 3], 0)
        s.add_response("a", [1], [1, 2, 4], 1)
        s.add_response("b", [2], [5, 6], 0)
        return s
    full = fill(store()).history_bytes()
    s = fill(store(memory_budget=full - 1))
    assert [(r.key, r.epoch) for r in s.records()] == [("a", 1), ("b", 0)]
    assert s.history_bytes() <= full - 1 and s.check_integrity()


@settings(max_examples=20, deadline=None)
@given(hist=st.lists(tokens, min_size=1, max_size=8), ctx=st.lists(st.integers(0, 5), max_size=8))
def test_store_drafts_occur_in_allowed_history(hist, ctx):
    s = store(use_live=False, prompt_prefix=0)
    for i, seq in enumerate(hist):
        s.add_response("p", PROMPT, seq, 0, float(i % 2))
    s.add_response("x", [0], [4, 4, 4, 4], 1)  # open epoch: not allowed for other prompts yet
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", ctx)
    d = s.speculate("q", 8)
    for path in d.paths():
        assert occurs_after(hist, ctx, path)


def test_misuse_raises_value_error_naming_the_problem():
    s = store()
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        s.add_tokens("nope", [1])
    s.start_request("r", PROMPT)
    with pytest.raises(ValueError, match="already started"):
        s.start_request("r", PROMPT)
    with pytest.raises(ValueError, match="max_tokens"):
        s.speculate("r", -1)
    with pytest.raises(ValueError, match="finite"):
        s.finish_request("r", reward=math.nan)
    with pytest.raises(ValueError, match="finite"):
        s.set_reward("r", math.inf)
    with pytest.raises(ValueError, match="token"):
        s.add_tokens("r", [1, -3])
    with pytest.raises(ValueError, match="token"):
        s.add_tokens("r", ["a"])
    with pytest.raises(ValueError, match="epoch"):
        s.add_response("p", PROMPT, [1], -1)
    s.add_response("p", PROMPT, [1], 0, sample=0)
    with pytest.raises(ValueError, match="sample 0"):
        s.add_response("p", PROMPT, [1], 0, sample=0)
    with pytest.raises(ValueError, match="no stored response"):
        s.set_reward(("p", 5), 1.0)
    with pytest.raises(ValueError, match="num_accepted"):
        s.record_acceptance("r", 1, 2)
    with pytest.raises(ValueError, match="max_depth"):
        StoreConfig(max_depth=1)
    with pytest.raises(ValueError, match="epoch_decay"):
        StoreConfig(epoch_decay=float("nan"))
    with pytest.raises(ValueError, match="backend"):
        DraftStore(backend="gpu")


def test_budget_and_window_bound_the_draft():
    s = store(window=WindowConfig(initial=3, minimum=2, maximum=8), use_global=False)
    s.add_response("p", PROMPT, list(range(1, 30)), 0)
    s.advance_epoch()
    s.start_request("q", PROMPT, "p")
    s.add_tokens("q", [1, 2])
    assert len(s.speculate("q", 10)) == 3
    assert len(s.speculate("q", 2)) == 2
    assert len(s.speculate("q", 0)) == 0
    assert s.record_acceptance("q", 3, 3) == 6
    assert len(s.speculate("q", 10)) == 6


def test_predict_length_known_and_unknown():
    s = store(default_length=100.0)
    assert s.predict_length("nothing") == 100.0
    for sample, n in enumerate([10, 20]):
        s.add_response("p", PROMPT, [1] * n, 0, sample=sample)
    for sample, n in enumerate([30, 50]):
        s.add_response("p", PROMPT, [1] * n, 1, sample=sample)
    assert s.predict_length("p") == pytest.approx(40 + 0.5 * 25)
    assert s.predict_length(PROMPT) == 40.0  # by token hash: a different, unknown key -> mean


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
@example([(False, 0), (True, 0), (True, 0), (False, 2), (False, 0)])  # equal records: by identity
def test_epoch_records_index_matches_a_scan(ops):
    """find / next_sample through the per-epoch index equal a linear scan, through any mix of
    appends and removals (duplicate sample numbers included)."""
    from array import array

    from rhyme_sglang.core.history import PromptHistory, ResponseRecord

    ph = PromptHistory("k", [], tree=None)
    live = []
    for add, sample in ops:
        if add or not live:
            rec = ResponseRecord("k", 0, sample, array("i"), 0)
            ph.group(0).append(rec)
            live.append(rec)
        else:
            rec = live.pop(sample % len(live))
            ph.records[0].remove(rec)
        for s in range(8):
            assert ph.find(0, s) is next((r for r in live if r.sample == s), None)
        assert ph.next_sample(0) == 1 + max((r.sample for r in live), default=-1)
    assert ph.find(1, 0) is None and ph.next_sample(1) == 0
