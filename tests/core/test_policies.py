"""Window rule, length statistics, LPT vs round-robin, trace I/O."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhyme_sglang.core import (LengthStats, SpecWindow, WindowConfig, assign_groups_lpt,
                               assign_groups_round_robin, group_leaders, lpt_order, makespan)
from rhyme_sglang.core.trace import TraceRecord, read_trace, write_trace


def test_window_grows_on_full_acceptance_and_backs_off():
    w = SpecWindow(WindowConfig(initial=4, minimum=2, maximum=16, decrease=0.5))
    assert w.update(4, 4) == 8
    assert w.update(8, 8) == 16
    assert w.update(16, 16) == 16            # capped
    assert w.update(16, 3) == 8              # halved
    assert w.update(8, 0) == 4
    assert w.update(4, 0) == 2
    assert w.update(2, 0) == 2               # floor
    assert w.update(0, 0) == 2               # nothing proposed: unchanged
    w.size = 16
    assert w.update(16, 12) == 13            # never below accepted + 1
    with pytest.raises(ValueError):
        w.update(2, 3)
    with pytest.raises(ValueError):
        WindowConfig(initial=1, minimum=2)


def test_length_stats_summary_and_prediction():
    ls = LengthStats(default=64.0)
    assert ls.predict("x") == 64.0
    for s, n in enumerate([10, 30]):
        ls.record("a", 0, s, n)
    for s, n in enumerate([40, 60]):
        ls.record("a", 1, s, n)
    ls.record("b", 0, 0, 4)
    summ = ls.summary("a")
    assert (summ.epoch, summ.mean, summ.max, summ.trend) == (1, 50.0, 60, 30.0)
    assert ls.predict("a") == 65.0
    assert ls.predict("unknown") == pytest.approx((50 + 4) / 2)
    with pytest.raises(ValueError):
        ls.record("a", 0, 0, -1)


def test_length_predictions_follow_every_change():
    """Predictions are memoised (the scheduler asks on every pass): each change must show."""
    ls = LengthStats(default=64.0)
    assert ls.predict("unknown") == 64.0 and ls.predict("a") == 64.0
    ls.record("a", 0, 0, 10)
    assert ls.predict("unknown") == 10.0 and ls.predict("a") == 10.0
    ls.record("b", 0, 0, 30)
    assert ls.predict("unknown") == 20.0 and ls.predict("b") == 30.0
    ls.record("a", 1, 0, 20)  # trend +10: 20 + 5
    assert ls.predict("a") == 25.0 and ls.predict("unknown") == 25.0
    ls.forget("nothing-here")
    assert ls.predict("a") == 25.0
    ls.forget("a")  # its latest mean (20) stays in the unknown-prompt mean
    assert ls.predict("a") == 25.0 and ls.predict("unknown") == 25.0
    other = LengthStats()
    assert other.predict("b") == 512.0
    other.load_state(ls.to_state())  # snapshots hold the kept prompts only
    assert other.predict("b") == 30.0 and other.predict("unknown") == 30.0
    ls.record("a", 2, 0, 50)  # back: its own statistics, no longer counted as forgotten
    assert ls.predict("a") == 50.0 and ls.predict("unknown") == 40.0


def test_forgotten_prompts_keep_the_unknown_prediction(monkeypatch):
    """An engine that drops each step's prompts predicts an unseen prompt as one that kept
    them all, up to the latest FORGOTTEN_MEANS forgotten prompts."""
    from rhyme_sglang.core import lengths

    kept, dropped = LengthStats(default=512.0), LengthStats(default=512.0)
    for i, n in enumerate([100, 300, 200]):
        for ls in (kept, dropped):
            ls.record(f"p{i}", 0, 0, n)
        dropped.forget(f"p{i}")
    assert dropped.keys() == [] and dropped.predict("new") == kept.predict("new") == 200.0
    assert dropped.estimate_memory() == 3 * 100  # a mean each
    monkeypatch.setattr(lengths, "FORGOTTEN_MEANS", 3)
    dropped.record("p3", 0, 0, 700)
    dropped.forget("p3")  # p0 (100) is the oldest forgotten: it goes
    assert dropped.predict("new") == pytest.approx((300 + 200 + 700) / 3)
    assert dropped.estimate_memory() == 3 * 100


def test_lpt_beats_round_robin_on_skewed_loads():
    groups = ["g0", "g1", "g2", "g3", "g4", "g5"]
    loads = [10, 1, 10, 1, 1, 1]
    load = dict(zip(groups, loads)).get
    lpt = assign_groups_lpt(groups, loads, 2)
    rr = assign_groups_round_robin(groups, 2)
    assert makespan(lpt, load) == 12 < makespan(rr, load) == 21
    assert sorted(g for e in lpt for g in e) == groups
    assert lpt_order(["a", "b", "c"], [1.0, 3.0, 1.0]) == ["b", "a", "c"]
    with pytest.raises(ValueError):
        lpt_order(["a"], [1.0, 2.0])
    with pytest.raises(ValueError):
        assign_groups_lpt(groups, loads, 0)
    with pytest.raises(ValueError):
        lpt_order(["a"], [float("nan")])


def test_trace_round_trip_and_validation(tmp_path):
    rec = TraceRecord("p", 0, 1, [1, 2], [3, 2], 1.0, "stop")
    path = str(tmp_path / "t.jsonl.gz")
    assert write_trace(path, [rec]) == 1
    assert read_trace(path) == [rec]
    bad_lines = ['{"prompt_id": "p"}', "not json",
                 json.dumps({**rec.__dict__, "reward": float("nan")}),
                 json.dumps({**rec.__dict__, "finish_reason": "eos"}),
                 json.dumps({**rec.__dict__, "response_token_ids": [1, -2]})]
    for i, line in enumerate(bad_lines):
        p = tmp_path / f"bad{i}.jsonl"
        p.write_text(line + "\n")
        with pytest.raises(ValueError, match=f"bad{i}.jsonl:1"):
            read_trace(str(p))
    dup = tmp_path / "dup.jsonl.gz"
    with gzip.open(dup, "wt") as fh:
        fh.write(json.dumps(rec.__dict__) + "\n" + json.dumps(rec.__dict__) + "\n")
    with pytest.raises(ValueError, match="duplicate"):
        read_trace(str(dup))


def test_lpt_group_order_keeps_groups_together_longest_first():
    from rhyme_sglang.core import lpt_group_order

    keys = ["a", "b", "a", "c", "b", "d"]
    order = lpt_group_order(keys, {"a": 3.0, "b": 9.0, "c": 3.0})
    # b (9) first; a and c tie at 3 and keep first-appearance order; unknown d counts as 0
    assert [keys[i] for i in order] == ["b", "b", "a", "a", "c", "d"]
    assert order[:2] == [1, 4] and order[2:4] == [0, 2]


# ---- group-aware prefill --------------------------------------------------------------------
def test_group_leaders_take_one_per_uncached_prompt():
    keys = ["a", "a", "b", "a", "b", "c"]
    assert group_leaders(keys, set(), [100] * 6) == [True, False, True, False, False, True]


def test_group_leaders_take_all_of_a_running_group():
    keys = ["a", "a", "b", "b"]
    assert group_leaders(keys, {"a"}, [100] * 4) == [True, True, True, False]


def test_group_leaders_hold_siblings_of_a_chunked_prefill():
    assert group_leaders(["a", "a", "b"], set(), [100] * 3, prefilling_keys={"a"}) == [
        False, False, True]


def test_group_leaders_take_all_of_a_cached_prompt():
    keys = ["a", "a", "b", "b", "c", "c", "d"]
    asked = []

    def is_cached(i):
        asked.append(i)
        return keys[i] in {"a", "c", "d"}

    take = group_leaders(keys, set(), [100] * 7, is_cached=is_cached)
    assert take == [True, True, True, False, True, True, True]
    assert asked == [0, 2, 4]  # each group's first request, once, and only with a sibling behind
    # a chunked prefill of a cached prompt holds nothing back (little is left to share)
    assert group_leaders(["a", "a"], set(), [100] * 2, prefilling_keys={"a"},
                         is_cached=lambda i: True) == [True, True]
    assert group_leaders(["a", "a"], {"a"}, [100] * 2, is_cached=lambda i: 1 / 0) == [True, True]


def test_group_leaders_never_hold_short_prompts():
    assert group_leaders(["a", "a", "a", "a"], set(), [8, 40, 8, 40], min_shared=32) == [
        True, True, True, False]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 80)), max_size=30),
       st.sets(st.sampled_from("abcd")))
def test_group_leaders_properties(reqs, running):
    keys = [k for k, _ in reqs]
    lens = [n for _, n in reqs]
    take = group_leaders(keys, running, lens)
    for key in set(keys):
        mine = [i for i, k in enumerate(keys) if k == key]
        long_ones = [i for i in mine if lens[i] >= 32]
        held = [i for i in long_ones if not take[i]]
        if key in running:
            assert not held  # a cached prompt never waits
        elif long_ones:  # an uncached prompt: its first long request goes, the others wait
            assert held == long_ones[1:]
        assert all(take[i] for i in mine if lens[i] < 32)
    with pytest.raises(ValueError):
        group_leaders(["a"], set(), [])
