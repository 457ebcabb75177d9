"""The native module gives bit-identical drafts to the pure-Python reference."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import contexts, tokens
from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core.combine import mix_draft_py
from rhyme_sglang.core.native import native_available, native_module
from rhyme_sglang.core.pytree import PySuffixTrie

pytestmark = pytest.mark.skipif(not native_available(),
                                reason="native module not built (pip install -e . or setup.py build_ext --inplace)")

ops = st.lists(st.tuples(st.integers(0, 2), st.booleans(), tokens, st.integers(1, 50)), max_size=30)


@settings(max_examples=80, deadline=None)
@given(ops=ops, depth=st.integers(2, 10), ctx=contexts, pattern=st.integers(1, 8),
       budget=st.integers(0, 12), min_prob=st.sampled_from([0.0, 0.05, 0.3]),
       branch=st.integers(1, 4), prior=st.sampled_from([0.0, 1.0, 2.5]),
       weights=st.lists(st.sampled_from([0.0, 0.2, 1.0]), min_size=3, max_size=3))
def test_trie_and_mix_parity(ops, depth, ctx, pattern, budget, min_prob, branch, prior, weights):
    nat = native_module()
    py_t = [PySuffixTrie(depth) for _ in range(3)]
    na_t = [nat.SuffixTrie(depth) for _ in range(3)]
    stored = [[], [], []]
    for which, remove, seq, w in ops:
        if remove and stored[which]:
            s, ws = stored[which].pop()
            py_t[which].update(s, 0, -1, -ws)
            na_t[which].update(s, 0, -1, -ws)
        else:
            py_t[which].update(seq, 0, 1, w)
            na_t[which].update(seq, 0, 1, w)
            stored[which].append((seq, w))
    for a, b in zip(py_t, na_t):
        assert a.num_nodes == b.num_nodes
        args = (ctx, pattern, budget, min_prob, branch, prior)
        assert tuple(a.draft(*args)) == tuple(b.draft(*args))
    args = (ctx, pattern, budget, min_prob, branch, prior)
    assert tuple(mix_draft_py(py_t, weights, *args)) == tuple(nat.mix_draft(na_t, weights, *args))


@settings(max_examples=15, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 2), tokens, st.floats(0, 1)), min_size=1, max_size=20),
       ctx=contexts)
def test_store_parity(seqs, ctx):
    stores = [DraftStore(StoreConfig(max_depth=8, max_pattern=4), backend=b) for b in ("python", "native")]
    for s in stores:
        for epoch in range(3):
            for p, seq, r in seqs:
                s.add_response(f"p{p}", [9, p], seq, epoch, r)
            s.advance_epoch()
        s.start_request("r", [9, 0], "p0")
        s.add_tokens("r", ctx)
    assert stores[0].speculate("r", 8) == stores[1].speculate("r", 8)
