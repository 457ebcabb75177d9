"""A prompt's history moves between stores: the importing store drafts as the exporting one."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import BACKENDS, tokens
from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core.transfer import response_state

CFG = StoreConfig(max_depth=8, max_pattern=4, epoch_decay=0.7)


def _drafts(s, key, contexts):
    out = []
    for i, ctx in enumerate(contexts):
        s.start_request(f"probe{i}", [7, 8, 1], key)
        s.add_tokens(f"probe{i}", ctx)
        d = s.speculate(f"probe{i}", 6)
        out.append((d.token_ids, d.parents, d.probs))
        s.finish_request(f"probe{i}", add_to_history=False)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(resp=st.lists(st.tuples(tokens, st.floats(-1, 1)), min_size=1, max_size=10),
       contexts=st.lists(st.lists(st.integers(0, 5), max_size=6), min_size=1, max_size=4),
       epochs=st.integers(1, 3))
def test_moved_prompt_drafts_like_its_source(backend, resp, contexts, epochs):
    src, dst = DraftStore(CFG, backend=backend), DraftStore(CFG, backend=backend)
    for e in range(epochs):
        for i, (seq, r) in enumerate(resp):
            src.add_response("p", [7, 8, 1], seq, e, r)
        src.advance_epoch()
        dst.advance_epoch()
    state = json.loads(json.dumps(src.export_prompt("p")))  # survives JSON (HTTP)
    assert dst.import_prompt(state) == src.num_responses
    assert dst.check_integrity() and src.check_integrity()
    assert _drafts(dst, "p", contexts) == _drafts(src, "p", contexts)
    assert dst.predict_length("p") == src.predict_length("p")
    assert dst.import_prompt(state) == 0  # idempotent: held responses are skipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_replace_swaps_a_partial_response_for_the_full_one(backend):
    s = DraftStore(CFG, backend=backend)
    s.add_response("p", [7, 8, 1], [4, 5], 0, None, sample=2)  # the partial record
    full = response_state("p", [7, 8, 1], [1, 2, 3, 4, 5], sample=2, reward=1.0)  # epoch 0
    assert s.import_prompt(full) == 0
    assert s.import_prompt(full, replace=True) == 1
    assert s.check_integrity() and s.num_responses == 1
    (rec,) = list(s.records())
    assert list(rec.seq)[-5:] == [1, 2, 3, 4, 5] and rec.reward == 1.0


@pytest.mark.parametrize("bad", [
    None, {"format": 9}, {"format": 1, "prompt_id": "", "records": []},
    {"format": 1, "prompt_id": "p", "records": {}},
    {"format": 1, "prompt_id": "p", "records": [{"epoch": -1, "sample": 0, "response": [1]}]},
    {"format": 1, "prompt_id": "p", "records": [{"epoch": 0, "sample": 0, "response": "ab"}]},
    {"format": 1, "prompt_id": "p", "records": [{"epoch": 0, "sample": 0, "response": [1],
                                                 "reward": float("nan")}]},
    {"format": 1, "prompt_id": "p", "records": [{"epoch": 0, "sample": 0, "response": [1]},
                                                {"epoch": 0, "sample": 0, "response": [2]}]},
])
def test_malformed_history_is_refused_and_changes_nothing(bad):
    s = DraftStore(CFG)
    s.add_response("q", [1], [2, 3], 0)
    with pytest.raises(ValueError):
        s.import_prompt(bad)
    assert s.num_responses == 1 and s.num_prompts == 1 and s.check_integrity()


def test_unknown_prompt_export_names_it():
    with pytest.raises(ValueError, match="nope"):
        DraftStore(CFG).export_prompt("nope")
