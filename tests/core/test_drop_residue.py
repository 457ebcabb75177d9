"""The residue of dropped prompts (issue 49): `drop_prompts` keeps the dropped responses'
global-trie contributions, up to `StoreConfig.dropped_global_tokens`, so a store that loads
each step's prompts and drops the rest drafts like one that keeps every history, counts
nothing twice when a prompt comes back, and stays within its bounds."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import BACKENDS
from rhyme_sglang.core import DraftStore, StoreConfig

CFG = StoreConfig(max_depth=8, max_pattern=4, global_depth=6, epoch_decay=0.7,
                  run_ahead_min_tokens=1)
KEYS = ("a", "b", "c", "d")
PROMPTS = {k: [9, 20 + i] for i, k in enumerate(KEYS + ("fresh",))}


def _prompt(key):
    return PROMPTS[key]


def _add(s, rid, key, tokens, run_ahead=False):
    s.start_request(rid, _prompt(key), key, run_ahead=run_ahead)
    s.add_tokens(rid, tokens)
    return s.finish_request(rid, None if run_ahead else 1.0)


def _drafts(s, key, contexts):
    out = []
    for i, ctx in enumerate(contexts):
        rid = f"probe-{key}-{i}"
        s.start_request(rid, _prompt(key), key)
        s.add_tokens(rid, ctx)
        d = s.speculate(rid, 6)
        out.append((d.token_ids, d.parents, d.probs))
        s.finish_request(rid, add_to_history=False)
    return out


def _fill(s):
    for key in KEYS:
        for i in range(3):
            _add(s, f"{key}{i}", key, [KEYS.index(key), i, 4, 5, 6, i])
        _add(s, f"{key}x", key, [5, 4, KEYS.index(key)], run_ahead=True)
    s.advance_epoch()
    _add(s, "b-open", "b", [2, 2, 4, 5, 7])  # open epoch: waits for the global trie
    return s


CONTEXTS = [[4, 5], [0, 1, 4], [5, 4], [2, 2], [4, 5, 7]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropped_prompt_keeps_drafting_for_the_others(backend):
    kept, s = _fill(DraftStore(CFG, backend=backend)), _fill(DraftStore(CFG, backend=backend))
    assert s.drop_prompts(["b", "c"]) == 2
    assert s.num_prompts == 2 and {r.key for r in s.records()} == {"a", "d"}
    assert s.check_integrity() and s._residue_records == 9
    s.advance_epoch()  # b's open-epoch record reaches the global trie as in `kept`
    kept.advance_epoch()
    # the global trie is the same, so a prompt without history drafts alike in both
    assert _drafts(s, "fresh", CONTEXTS) == _drafts(kept, "fresh", CONTEXTS)
    assert s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_that_comes_back_counts_nothing_twice(backend):
    kept, s = _fill(DraftStore(CFG, backend=backend)), _fill(DraftStore(CFG, backend=backend))
    s.advance_epoch()
    kept.advance_epoch()
    exported = {k: s.export_prompt(k) for k in ("b", "c")}
    bytes_before = s.history_bytes()
    assert s.drop_prompts(["b", "c"]) == 2
    for k in ("b", "c"):
        assert s.import_prompt(exported[k]) == len(exported[k]["records"])
    assert s._residue_records == 0 and s.num_responses == kept.num_responses
    assert s.check_integrity() and s.history_bytes() == bytes_before
    for key in KEYS + ("fresh",):
        assert _drafts(s, key, CONTEXTS) == _drafts(kept, key, CONTEXTS), key
    # a request of a dropped prompt ends its residue too: it drafts as a prompt never seen
    assert s.drop_prompts(["c"]) == 1 and s._residue_records == 4
    s.start_request("c-new", _prompt("c"), "c")
    assert s._residue_records == 0 and s.check_integrity()
    s.finish_request("c-new", add_to_history=False)
    ref = DraftStore(CFG, backend=backend)
    ref.advance_epoch()
    ref.advance_epoch()  # the epoch `kept` exports at
    for key in ("a", "b", "d"):
        ref.import_prompt(kept.export_prompt(key))
    assert _drafts(s, "fresh", CONTEXTS) == _drafts(ref, "fresh", CONTEXTS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_residue_is_bounded_and_the_earliest_drop_goes_first(backend):
    s = _fill(DraftStore(dataclasses.replace(CFG, dropped_global_tokens=20), backend=backend))
    one = sum(len(r.seq) for r in s.records() if r.key == "a")  # 4 records of 8 or 5 tokens
    assert one <= 40
    s.drop_prompts(["a"])
    assert s._residue_tokens == 0  # a alone is over 20 tokens: nothing is kept
    s = _fill(DraftStore(dataclasses.replace(CFG, dropped_global_tokens=2 * one),
                         backend=backend))
    s.drop_prompts(["a"])
    s.drop_prompts(["d"])
    assert list(s._residue) == ["a", "d"] and s.check_integrity()
    s.drop_prompts(["c"])  # over the bound: a (dropped first) leaves the global trie
    assert list(s._residue) == ["d", "c"] and s._residue_tokens <= 2 * one
    assert s.check_integrity()
    # none at all: a drop removes the global contributions too
    none = _fill(DraftStore(dataclasses.replace(CFG, dropped_global_tokens=0), backend=backend))
    none.drop_prompts(list(KEYS))
    assert none._residue_records == 0 and none.check_integrity()
    empty = DraftStore(CFG, backend=backend)  # drafts from the probe's own tokens only
    assert _drafts(none, "fresh", CONTEXTS) == _drafts(empty, "fresh", CONTEXTS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_memory_budget_and_the_history_window_take_the_residue_first(backend):
    s = _fill(DraftStore(CFG, backend=backend))
    s.advance_epoch()
    s.drop_prompts(["a", "b"])
    s.config = dataclasses.replace(s.config, memory_budget=s.history_bytes() - 1)
    s._enforce_budget()
    assert list(s._residue) == ["b"] and s.num_prompts == 2  # a's residue went, not c or d
    assert s.check_integrity()
    win = _fill(DraftStore(dataclasses.replace(CFG, history_epochs=1), backend=backend))
    win.drop_prompts(["a", "b"])  # a: epoch 0 only; b: epoch 0 and the open epoch 1
    win.advance_epoch()  # epoch 0 is outside the window of 1
    assert [r.epoch for r in win.residue_records()] == [1] and win.check_integrity()
    assert list(win._residue) == ["b"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rebase_and_a_snapshot_keep_the_store_consistent(backend, tmp_path):
    cfg = dataclasses.replace(CFG, epoch_decay=0.01)
    s, kept = DraftStore(cfg, backend=backend), DraftStore(cfg, backend=backend)
    for e in range(5):
        for key in KEYS if e <= 2 else ("c", "d"):
            for store in (s, kept):
                _add(store, f"{key}{e}", key, [e, KEYS.index(key), 4, 5])
        if e == 2:
            s.drop_prompts(["a", "b"])
        s.advance_epoch()
        kept.advance_epoch()
    assert s.epoch_origin > 0 and s._residue_records == 6  # rebased with a and b away
    assert s.check_integrity()
    assert _drafts(s, "fresh", CONTEXTS) == _drafts(kept, "fresh", CONTEXTS)
    s.save(str(tmp_path / "s.rds"))
    loaded = DraftStore(backend=backend)
    loaded.load(str(tmp_path / "s.rds"))  # a snapshot holds the prompts, not the residue
    assert loaded.num_responses == s.num_responses and loaded._residue_records == 0
    assert loaded.check_integrity()


OPS = st.lists(st.tuples(st.sampled_from(("add", "drop", "back", "epoch")),
                         st.sampled_from(KEYS),
                         st.lists(st.integers(0, 5), min_size=1, max_size=8)),
               max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_any_sequence_drafts_like_a_store_that_never_drops(ops):
    """Load-per-step against all-in-one: after any adds, drops, re-imports and epoch closes
    (within the residue's bound), a prompt without history drafts alike in both at every
    point, and every prompt does once it is loaded back."""
    s, ref = DraftStore(CFG, backend="python"), DraftStore(CFG, backend="python")
    away = {}
    for i, (op, key, tokens) in enumerate(ops):
        if op == "add" and key not in away:
            for store in (s, ref):
                _add(store, f"r{i}", key, tokens)
        elif op == "drop" and s.has_prompt(key) and key not in away:
            away[key] = s.export_prompt(key)
            assert s.drop_prompts([key]) == 1
        elif op == "back" and key in away:
            s.import_prompt(away.pop(key))
        elif op == "epoch":
            s.advance_epoch()
            ref.advance_epoch()
        assert s.check_integrity()
        # whatever is away, its cross-prompt contributions still draft
        assert _drafts(s, "fresh", CONTEXTS) == _drafts(ref, "fresh", CONTEXTS)
    for key, state in away.items():
        s.import_prompt(state)
    assert s.check_integrity() and s.num_responses == ref.num_responses
    for key in KEYS + ("fresh",):
        assert _drafts(s, key, CONTEXTS) == _drafts(ref, key, CONTEXTS), key
