"""Draft-only (run-ahead) records and dropping prompts (issue 49): a run-ahead record drafts
at `run_ahead_weight` times a real response's weight, never takes a reward, never collides with
a real response's (epoch, sample), is no evidence for length prediction, keeps its mark through
export / import / snapshots; `drop_prompts` removes whole prompts with exact memory accounting
and keeps prompts with a request in flight."""

import dataclasses
import json
import math

import pytest

from helpers import BACKENDS
from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core import weights as W

CFG = StoreConfig(max_depth=8, max_pattern=4, epoch_decay=0.7, run_ahead_weight=0.25,
                  run_ahead_min_tokens=1)
PROMPT = [7, 8, 1]


def _run_ahead(s, rid, key, tokens, sample=None, prompt=PROMPT):
    """A run-ahead request of `key` that generated `tokens`, then finished (or was aborted)."""
    s.start_request(rid, prompt, key, sample, run_ahead=True)
    s.add_tokens(rid, tokens)
    return s.finish_request(rid)


def _real(s, rid, key, tokens, sample=None, prompt=PROMPT, reward=None):
    s.start_request(rid, prompt, key, sample)
    s.add_tokens(rid, tokens)
    return s.finish_request(rid, reward)


def _drafts(s, key, contexts, prompt=PROMPT):
    out = []
    for i, ctx in enumerate(contexts):
        s.start_request(f"probe{i}", prompt, key)
        s.add_tokens(f"probe{i}", ctx)
        d = s.speculate(f"probe{i}", 6)
        out.append((d.token_ids, d.parents, d.probs))
        s.finish_request(f"probe{i}", add_to_history=False)
    return out


def _close(ahead, real, factor):
    """`ahead`'s weight is `factor` x `real`'s up to the integer rounding of each."""
    return abs(ahead.weight - factor * real.weight) <= 1 + factor


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_ahead_record_weighs_run_ahead_weight_times_a_real_one(backend):
    s = DraftStore(CFG, backend=backend)
    real = _real(s, "r0", "p", [1, 2, 3, 4])
    ahead = _run_ahead(s, "a0", "p", [1, 2, 5])
    assert ahead.run_ahead and not real.run_ahead
    assert ahead.weight == W.response_weight(0.25, 0, 0, 0.7)
    assert _close(ahead, real, 0.25)
    for _ in range(3):  # older epochs: both decay alike; closing epochs flushes their groups
        s.advance_epoch()
        newer = _real(s, f"r{s.epoch}", "p", [1, 2, 3, 4])
        newer_ahead = _run_ahead(s, f"a{s.epoch}", "p", [1, 2, 5])
        assert _close(newer_ahead, newer, 0.25)
        assert _close(ahead, real, 0.25)
    assert s.num_run_ahead == 4 and s.num_responses == 8 and s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rewards_in_its_group_leave_a_run_ahead_record_neutral(backend):
    s = DraftStore(CFG, backend=backend)
    _real(s, "r0", "p", [1, 2, 3], sample=0, reward=1.0)
    _real(s, "r1", "p", [1, 2, 4], sample=1, reward=0.0)
    ahead = _run_ahead(s, "a0", "p", [1, 2, 5], sample=0)
    s.advance_epoch()  # closes the group: the real ones are re-weighted by advantage
    group = s._prompts["p"].records[0]
    assert {r.weight for r in group if not r.run_ahead} != {W.response_weight(1.0, 0, 0, 0.7)}
    assert ahead.factor == 1.0 and ahead.reward is None
    assert ahead.weight == W.response_weight(0.25, 0, 0, 0.7) and s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ratio_survives_a_rebase(backend):
    s = DraftStore(StoreConfig(max_depth=8, max_pattern=4, epoch_decay=0.01,
                               run_ahead_weight=0.5, run_ahead_min_tokens=1), backend=backend)
    for _ in range(5):
        real = _real(s, f"r{s.epoch}", "p", [1, 2, 3])
        ahead = _run_ahead(s, f"a{s.epoch}", "p", [1, 2, 4])
        s.advance_epoch()
    assert s.epoch_origin > 0  # 0.01 ** -4 passed MAX_RECENCY_FACTOR: the weights were rebased
    assert _close(ahead, real, 0.5) and s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reward_targets_skip_run_ahead_records_and_requests(backend):
    s = DraftStore(CFG, backend=backend)
    _run_ahead(s, "a0", "p", [1, 2, 5], sample=3)
    assert not s.has_reward_target(("p", 3)) and not s.has_reward_target("a0")
    with pytest.raises(ValueError, match="'p' sample 3"):
        s.set_reward(("p", 3), 1.0)
    with pytest.raises(ValueError, match="'a0'"):
        s.set_reward("a0", 1.0)
    real = _real(s, "r3", "p", [1, 2, 6], sample=3)
    assert s.has_reward_target(("p", 3))
    s.set_reward(("p", 3), 1.0)  # goes to the real response
    assert real.reward == 1.0
    assert all(r.reward is None for r in s.records() if r.run_ahead)
    s.start_request("a1", PROMPT, "p", 4, run_ahead=True)  # in flight
    assert not s.has_reward_target("a1")
    with pytest.raises(ValueError, match="run-ahead"):
        s.set_reward("a1", 1.0)
    s.add_tokens("a1", [1])
    assert s.finish_request("a1", reward=2.0).reward is None  # a reward at finish is ignored
    assert s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_epoch_sample_collision_with_real_responses(backend):
    s = DraftStore(CFG, backend=backend)
    ahead = _run_ahead(s, "a0", "p", [1, 2, 5], sample=0)
    real = _real(s, "r0", "p", [1, 2, 3], sample=0)  # keeps its sample: the run-ahead one
    assert (real.sample, ahead.sample) == (0, 0)       # lives in its own sample space
    ph = s._prompts["p"]
    assert ph.find(0, 0) is real and ph.find(0, 0, run_ahead=True) is ahead
    again = _run_ahead(s, "a1", "p", [1, 2, 7], sample=0)  # a held run-ahead sample moves on
    assert again.sample == 1 and ph.find(0, 0, run_ahead=True) is ahead
    assert ph.next_sample(0) == 1 and ph.next_sample(0, run_ahead=True) == 2
    s.add_response("p", PROMPT, [1, 9], 0, sample=5, run_ahead=True)
    with pytest.raises(ValueError, match="run-ahead response for epoch 0 sample 5"):
        s.add_response("p", PROMPT, [1, 9], 0, sample=5, run_ahead=True)
    assert s.add_response("p", PROMPT, [1, 9], 0, sample=5).sample == 5  # real sample 5 free
    assert ph.next_sample(0) == 6 and s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_prediction_ignores_run_ahead_records(backend):
    s = DraftStore(StoreConfig(default_length=100.0), backend=backend)
    _run_ahead(s, "a0", "p", [1] * 7)
    assert s.predict_length("p") == 100.0  # no real response yet: the default
    _real(s, "r0", "p", [1] * 40)
    _run_ahead(s, "a1", "p", [1] * 3)
    assert s.predict_length("p") == 40.0
    assert s.lengths.keys() == ["p"] and s.lengths.summary("p").lengths == {0: 40}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_run_ahead_response_adds_nothing(backend):
    s = DraftStore(CFG, backend=backend)
    s.start_request("a0", PROMPT, "p", 0, run_ahead=True)  # aborted before its first token
    assert s.finish_request("a0") is None
    assert s.num_responses == 0 and s.num_prompts == 0 and s.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aborted_run_ahead_response_below_the_minimum_is_not_kept(backend):
    cfg = dataclasses.replace(CFG, run_ahead_min_tokens=4)
    assert StoreConfig().run_ahead_min_tokens == 32
    s = DraftStore(cfg, backend=backend)
    s.start_request("a0", PROMPT, "p", run_ahead=True)
    s.add_tokens("a0", [1, 2, 3])
    assert s.finish_request("a0", truncated=True) is None  # 3 < 4 tokens of an aborted one
    assert s.num_responses == 0 and s.num_prompts == 0 and s.check_integrity()
    s.start_request("a1", PROMPT, "p", run_ahead=True)
    s.add_tokens("a1", [1, 2, 3, 4])
    assert s.finish_request("a1", truncated=True).run_ahead  # 4 tokens: kept
    assert _run_ahead(s, "a2", "p", [5, 6]).run_ahead  # finished whole: kept at any length
    # explicit additions and imports carry whole records: any length
    assert s.add_response("p", PROMPT, [1, 2], 0, run_ahead=True) is not None
    assert s.num_run_ahead == 3 and s.check_integrity()
    s.start_request("r0", PROMPT, "p")  # truncated changes nothing for a real response
    s.add_tokens("r0", [1])
    assert s.finish_request("r0", truncated=True).run_ahead is False
    with pytest.raises(ValueError, match="run_ahead_min_tokens"):
        StoreConfig(run_ahead_min_tokens=0)


def _mixed_store(backend):
    s = DraftStore(CFG, backend=backend)
    _real(s, "r0", "p", [1, 2, 3, 4], sample=0, reward=1.0)
    _run_ahead(s, "a0", "p", [1, 2, 5], sample=0)
    s.advance_epoch()
    _real(s, "r1", "p", [2, 3, 4], sample=1)
    _run_ahead(s, "a1", "p", [3, 4, 1, 2], sample=1)
    return s


def _summary(s):
    return sorted((r.key, r.epoch, r.sample, r.run_ahead, r.weight, r.reward, list(r.seq))
                  for r in s.records())


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_import_keeps_the_mark(backend):
    src = _mixed_store(backend)
    state = json.loads(json.dumps(src.export_prompt("p")))  # JSON-safe
    marks = [(r["epoch"], r["sample"], r.get("run_ahead")) for r in state["records"]]
    assert sorted(marks, key=str) == sorted([(0, 0, None), (0, 0, True), (1, 1, None),
                                             (1, 1, True)], key=str)
    assert all("run_ahead" not in r for r in state["records"] if r["reward"] is not None)
    dst = DraftStore(CFG, backend=backend)
    dst.advance_epoch()
    assert dst.import_prompt(state) == 4
    assert _summary(dst) == _summary(src) and dst.num_run_ahead == 2 and dst.check_integrity()
    contexts = [[1, 2], [3, 4], [2]]
    assert _drafts(dst, "p", contexts) == _drafts(src, "p", contexts)
    assert dst.import_prompt(state) == 0  # every (epoch, sample, kind) is held now
    assert not dst.has_reward_target("a0")  # an imported run-ahead rid takes no reward either


def test_an_export_without_run_ahead_keys_imports_as_real_responses():
    old = {"format": 1, "prompt_id": "p", "prompt_tail": [7, 8, 1], "epoch": 0,
           "records": [{"epoch": 0, "sample": 0, "response": [1, 2], "reward": 0.5, "rid": None}]}
    s = DraftStore(CFG, backend="python")
    assert s.import_prompt(old) == 1 and s.num_run_ahead == 0
    assert s.export_prompt("p") == old  # byte-compatible: no key on a real response


@pytest.mark.parametrize("backend", BACKENDS)
def test_snapshots_keep_the_mark(backend, tmp_path):
    src = _mixed_store(backend)
    state = src.to_state()
    assert [r.get("run_ahead") for r in state["records"]].count(True) == 2
    assert all("run_ahead" not in r for r in state["records"] if not r.get("run_ahead"))
    copy = DraftStore.from_state(state, backend=backend)
    assert _summary(copy) == _summary(src) and copy.check_integrity()
    src.save(str(tmp_path / "s.rds"))
    loaded = DraftStore(backend=backend)
    loaded.load(str(tmp_path / "s.rds"))
    assert _summary(loaded) == _summary(src) and loaded.config == src.config
    assert loaded.num_run_ahead == 2 and not loaded.has_reward_target("a1")
    contexts = [[1, 2], [3, 4]]
    assert _drafts(loaded, "p", contexts) == _drafts(src, "p", contexts)


def _three_prompts(backend, cfg=None):
    s = DraftStore(cfg or dataclasses.replace(CFG, dropped_global_tokens=0), backend=backend)
    for key, first in (("a", 1), ("b", 2), ("c", 3)):
        for i in range(3):
            _real(s, f"{key}{i}", key, [first, i, 4, 5, first], prompt=[9, first])
        _run_ahead(s, f"{key}x", key, [first, 5, 4], prompt=[9, first])
    s.advance_epoch()  # epoch 0's records reach the global trie
    _real(s, "b-open", "b", [2, 2, 2], prompt=[9, 2])  # an open-epoch record: pending global
    return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_prompts_removes_their_whole_history(backend):
    """Without a residue (`dropped_global_tokens=0`); tests/core/test_drop_residue.py has it."""
    s = _three_prompts(backend)
    before = s.history_bytes()
    assert s.drop_prompts(["b", "zzz", "b"]) == 1  # unknown ids ignored, repeats once
    assert s.num_prompts == 2 and {r.key for r in s.records()} == {"a", "c"}
    assert s.check_integrity() and s.history_bytes() < before
    assert "b" not in s.lengths.keys() and s.predict_length("b") == s.predict_length("new")
    assert not s.has_reward_target(("b", 0)) and not s.has_reward_target("b0")
    s.advance_epoch()  # the dropped open-epoch record never reaches the global trie
    assert s.check_integrity()
    # the others draft as in a store that never held "b" (its global contributions are gone)
    ref = DraftStore(s.config, backend=backend)
    for key, first in (("a", 1), ("c", 3)):
        for i in range(3):
            _real(ref, f"{key}{i}", key, [first, i, 4, 5, first], prompt=[9, first])
        _run_ahead(ref, f"{key}x", key, [first, 5, 4], prompt=[9, first])
    ref.advance_epoch()
    ref.advance_epoch()
    contexts = [[1, 0, 4], [2, 1], [4, 5], [3, 5]]
    for key in ("a", "c", "fresh"):
        assert _drafts(s, key, contexts, [9, 1]) == _drafts(ref, key, contexts, [9, 1])
    assert s.drop_prompts(["a", "c"]) == 2 and s.num_prompts == 0 and s.num_responses == 0
    # what is left is the global trie's own (the native one keeps its freed blocks pooled)
    assert s.check_integrity() and s.history_bytes() == s._global.estimate_memory()


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_skips_prompts_with_a_request_in_flight(backend):
    s = _three_prompts(backend)
    s.start_request("live", [9, 1], "a")
    assert s.prompts_in_flight(["a", "b", "zzz"]) == ["a"]
    assert s.drop_prompts(["a", "b"]) == 1
    assert {r.key for r in s.records()} == {"a", "c"} and s.check_integrity()
    s.add_tokens("live", [1, 2])
    s.finish_request("live")
    assert s.prompts_in_flight(["a"]) == [] and s.drop_prompts(["a"]) == 1
    assert s.check_integrity()


@pytest.mark.parametrize("bad", ["p", None, [""], [1], ["p", None], {"p": 1}])
def test_bad_prompt_ids_raise_naming_them(bad):
    s = _three_prompts("python")
    with pytest.raises(ValueError, match="prompt_ids"):
        s.drop_prompts(bad)
    with pytest.raises(ValueError, match="prompt_ids"):
        s.prompts_in_flight(bad)
    assert s.num_prompts == 3 and s.check_integrity()


@pytest.mark.parametrize("weight", [0, 0.0, -0.5, 1.5, math.nan, math.inf, True, "0.5", None])
def test_run_ahead_weight_is_validated(weight):
    with pytest.raises(ValueError, match="run_ahead_weight"):
        StoreConfig(run_ahead_weight=weight)


def test_bad_run_ahead_inputs_raise_naming_them():
    s = DraftStore(CFG, backend="python")
    with pytest.raises(ValueError, match="run_ahead"):
        s.start_request("r", PROMPT, "p", run_ahead="yes")
    with pytest.raises(ValueError, match="run-ahead response takes no reward"):
        s.add_response("p", PROMPT, [1], 0, reward=1.0, run_ahead=True)
    base = {"format": 1, "prompt_id": "p", "prompt_tail": [7], "epoch": 0}
    rec = {"epoch": 0, "sample": 0, "response": [1], "reward": None, "rid": None}
    bad = [(dict(rec, run_ahead="true"), "run_ahead must be a boolean"),
           (dict(rec, run_ahead=True, reward=1.0), "takes no reward")]
    for item, message in bad:
        with pytest.raises(ValueError, match=message):
            s.import_prompt(dict(base, records=[item]))
    with pytest.raises(ValueError, match="two run-ahead records"):
        s.import_prompt(dict(base, records=[dict(rec, run_ahead=True)] * 2))
    assert s.num_prompts == 0 and s.num_responses == 0
    state = DraftStore(CFG, backend="python").to_state()
    state["prompts"] = [{"key": "p", "tail": [7]}]
    state["records"] = [{"key": "p", "epoch": 0, "sample": 0, "seq": [7, 1], "len": 1,
                         "reward": None, "factor": 1.0, "weight": 128, "rid": None,
                         "global": False, "run_ahead": 1}]
    with pytest.raises(ValueError, match="run_ahead must be a bool"):
        DraftStore.from_state(state, backend="python")
