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
       decay=st.sampled_from([1.0, 0.7, 0.33]),
       weights=st.lists(st.sampled_from([0.0, 0.2, 1.0]), min_size=3, max_size=3))
def test_trie_and_mix_parity(ops, depth, ctx, pattern, budget, min_prob, branch, prior, decay,
                             weights):
    nat = native_module()
    py_t = [PySuffixTrie(depth) for _ in range(3)]
    na_t = [nat.SuffixTrie(depth) for _ in range(3)]
    stored = [[], [], []]
    for which, remove, seq, w in ops:
        if remove and stored[which]:
            s, ws = stored[which].pop()
            py_t[which].remove(s, ws)
            na_t[which].remove(s, ws)
        else:
            py_t[which].insert(seq, w)
            na_t[which].insert(seq, w)
            stored[which].append((seq, w))
    for a, b in zip(py_t, na_t):
        assert a.num_nodes == b.num_nodes
        args = (ctx, pattern, budget, min_prob, branch, prior, decay)
        assert tuple(a.draft(*args)) == tuple(b.draft(*args))
    args = (ctx, pattern, budget, min_prob, branch, prior, decay)
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


small_tokens = st.lists(st.integers(0, 3), max_size=9)
lifecycle = st.lists(st.tuples(st.sampled_from(["insert", "extend", "extend", "reweight", "remove",
                                                "close"]),
                               small_tokens, st.integers(1, 40), st.integers(0, 10 ** 6)),
                     max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=lifecycle, depth=st.integers(2, 10), ctx=contexts)
def test_path_compressed_trie_matches_the_reference_through_a_lifecycle(ops, depth, ctx):
    """Inserts, incremental extensions (most of them as growing streams), re-weights, removals
    and stream closes in any order (small alphabet: many shared and duplicate continuations, so
    tails are split, shared, lengthened and dropped): the native trie's logical nodes, lookups and
    drafts always equal the uncompressed Python twin's, its integrity holds, and removing
    everything frees every record and token block."""
    nat = native_module()
    ref, trie, stored = PySuffixTrie(depth), nat.SuffixTrie(depth), []
    for op, seq, w, pick in ops:
        if op == "insert" or not stored:
            if pick % 3:  # a growing stream: each trie hands out its own handle
                handles = (ref.open_stream(seq, w), trie.open_stream(seq, w))
            else:
                ref.insert(seq, w)
                trie.insert(seq, w)
                handles = None
            stored.append((seq, w, handles))
            continue
        k = pick % len(stored)
        old, ow, handles = stored[k]
        if op == "extend":
            new = old + (seq or [0])
            ref.extend(new, len(old), ow, handles[0] if handles else -1)
            trie.extend(new, len(old), ow, handles[1] if handles else -1)
            stored[k] = (new, ow, handles)
        elif op == "reweight":
            dw = w if pick % 2 or ow <= w else -w
            ref.reweight(old, dw)
            trie.reweight(old, dw)
            stored[k] = (old, ow + dw, handles)
        elif op == "close":
            if handles:
                ref.close_stream(handles[0])
                trie.close_stream(handles[1])
            stored[k] = (old, ow, None)
        else:
            ref.remove(old, ow)
            trie.remove(old, ow)
            if handles:
                ref.close_stream(handles[0])
                trie.close_stream(handles[1])
            stored.pop(k)
        assert trie.check_integrity()
        assert trie.num_nodes == ref.num_nodes and trie.num_streams == ref.num_streams
        assert trie.num_explicit <= trie.num_nodes
        for path in (ctx[-2:], ctx[-1:], [0, 1], [2, 2, 2]):
            assert trie.lookup(path) == ref.lookup(path)
        args = (ctx, 4, 8, 0.0, 3, 1.0, 0.7)
        assert tuple(trie.draft(*args)) == tuple(ref.draft(*args))
    base = nat.SuffixTrie(depth).estimate_memory()
    for seq, w, handles in stored:
        trie.remove(seq, w)
        if handles:
            ref.close_stream(handles[0])
            trie.close_stream(handles[1])
    assert trie.num_streams == ref.num_streams == 0
    assert trie.num_nodes == 0 and trie.num_explicit == 0 and trie.check_integrity()
    assert trie.estimate_memory() - base < 32 * (len(ops) + 1)  # only the emptied block slots


@pytest.mark.parametrize("step", [1, 3, 16])
def test_growing_stream_is_as_compact_as_a_whole_insert(step):
    """A response fed a few tokens at a time as a stream (an in-flight request in a live trie)
    keeps its unary chains as tails: the same records as inserting it whole, the same content as
    the reference; without the stream every step turns the chains into explicit nodes."""
    nat = native_module()
    seq = list(range(100, 400))
    whole, streamed, plain, ref = (nat.SuffixTrie(24), nat.SuffixTrie(24), nat.SuffixTrie(24),
                                   PySuffixTrie(24))
    whole.insert(seq, 5)
    ref.insert(seq, 5)
    stream = streamed.open_stream(seq[:step], 5)
    plain.insert(seq[:step], 5)
    for lo in range(step, len(seq), step):
        part = seq[:lo + step]
        streamed.extend(part, lo, 5, stream)
        plain.extend(part, lo, 5)
    assert streamed.num_nodes == plain.num_nodes == whole.num_nodes == ref.num_nodes
    assert streamed.num_explicit == whole.num_explicit == len(seq)
    assert plain.num_explicit > 10 * len(seq)
    assert streamed.estimate_memory() < 1.2 * whole.estimate_memory()
    for probe in ([100], seq[:5], seq[50:70], seq[-3:]):
        assert streamed.lookup(probe) == ref.lookup(probe)
        assert tuple(streamed.draft(probe, 8, 8, 0.0, 2, 1.0, 0.7)) == tuple(ref.draft(probe, 8, 8, 0.0, 2, 1.0, 0.7))
    streamed.remove(seq, 5)
    streamed.close_stream(stream)
    assert streamed.num_nodes == 0 and streamed.num_streams == 0 and streamed.check_integrity()


def test_tails_compress_unary_chains():
    """A long response stored once costs one record per suffix start, not one per substring."""
    nat = native_module()
    trie, ref = nat.SuffixTrie(24), PySuffixTrie(24)
    seq = list(range(100, 300))
    trie.insert(seq, 1)
    ref.insert(seq, 1)
    assert trie.num_nodes == ref.num_nodes > 20 * len(seq)
    assert trie.num_explicit == len(seq)
    trie.insert(seq, 1)  # the same response again: counts grow, no new records
    assert trie.num_explicit == len(seq) and trie.lookup(seq[:5]) == (2, 2)
