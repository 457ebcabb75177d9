"""Property tests of the suffix trie (both backends): integrity, drafts really occur, removal."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import BACKENDS, contexts, occurs_after, tokens
from rhyme_sglang.core.native import make_trie
from rhyme_sglang.core.pytree import PySuffixTrie

ops = st.lists(st.tuples(st.booleans(), tokens, st.integers(1, 9)), min_size=1, max_size=25)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(ops=ops, depth=st.integers(2, 8), ctx=contexts)
def test_random_inserts_and_removals_keep_integrity(backend, ops, depth, ctx):
    trie, stored = make_trie(depth, backend), []
    for remove, seq, w in ops:
        if remove and stored:
            s, ws = stored.pop(0)
            trie.remove(s, ws)
        else:
            trie.insert(seq, w)
            stored.append((seq, w))
        assert trie.check_integrity()
    if not stored:
        assert trie.num_nodes == 0
    toks, parents, probs, score, mlen = trie.draft(ctx, 6, 8, 0.0, 3, 1.0)
    history = [s for s, _ in stored]
    paths = {}
    for i, (t, p) in enumerate(zip(toks, parents)):
        paths[i] = (paths[p] if p >= 0 else []) + [t]
        assert occurs_after(history, ctx, paths[i]), "draft path never follows the context"
        assert 0.0 < probs[i] <= 1.0 and (p < 0 or probs[i] <= probs[p])
    assert len(toks) <= 8 and abs(score - sum(probs)) < 1e-9
    assert mlen <= len(ctx)


@given(seq=tokens, cut=st.integers(0, 24))
@settings(max_examples=50, deadline=None)
def test_incremental_extension_equals_whole_insert(seq, cut):
    a, b = PySuffixTrie(5), PySuffixTrie(5)
    a.insert(seq, 3)
    cut = min(cut, len(seq))
    b.insert(seq[:cut], 3)
    b.extend(seq, cut, 3)
    for i in range(len(seq)):
        for j in range(i + 1, min(len(seq), i + 5) + 1):
            assert a.lookup(seq[i:j]) == b.lookup(seq[i:j])
    assert a.num_nodes == b.num_nodes


def test_counts_and_weights_are_occurrence_sums():
    t = PySuffixTrie(4)
    t.insert([1, 2, 1, 2], 10)
    t.insert([1, 2, 3], 5)
    assert t.lookup([1, 2]) == (3, 25)
    assert t.lookup([2, 3]) == (1, 5)
    assert t.lookup([9]) == (0, 0)
    t.remove([1, 2, 3], 5)
    assert t.lookup([2, 3]) == (0, 0) and t.check_integrity()


def test_draft_prefers_heavier_branch_and_reports_match():
    t = PySuffixTrie(8)
    t.insert([7, 1, 2, 3], 1)
    t.insert([7, 1, 4, 5], 3)
    toks, parents, probs, _, mlen = t.draft([0, 7, 1], 4, 1, 0.0, 4, 0.0)
    assert toks == [4] and parents == [-1] and mlen == 2 and probs == [0.75]


@pytest.mark.parametrize("backend", BACKENDS)
def test_removing_unknown_sequence_raises(backend):
    t = make_trie(4, backend)
    t.insert([1, 2], 1)
    with pytest.raises(ValueError):
        t.remove([3, 4], 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prior_decay_trusts_one_occurrence_more_after_a_longer_context(backend):
    t = make_trie(8, backend)
    t.insert([5, 6, 7, 8, 9], 1)
    # Context [7] matches 1 token, [5, 6, 7] matches 3; the single continuation (8) gets
    # conf = 1 / (1 + prior * decay**L) with L = tokens the matched node spells.
    _, _, short, _, m1 = t.draft([7], 4, 1, 0.0, 4, 2.0, 0.5)
    _, _, long_, _, m3 = t.draft([5, 6, 7], 4, 1, 0.0, 4, 2.0, 0.5)
    assert (m1, m3) == (1, 3)
    assert short == [pytest.approx(1 / (1 + 2.0 * 0.5))]
    assert long_ == [pytest.approx(1 / (1 + 2.0 * 0.125))]
    # Deeper draft nodes spell longer contexts: the second token's conditional uses L + 1.
    _, _, probs, _, _ = t.draft([7], 4, 2, 0.0, 4, 2.0, 0.5)
    assert probs[1] == pytest.approx(probs[0] / (1 + 2.0 * 0.25))
    # decay 1.0 is the plain C / (C + prior) rule
    assert t.draft([5, 6, 7], 4, 1, 0.0, 4, 2.0, 1.0)[2] == [pytest.approx(1 / 3)]
