"""The lossless tree verification op: exact draws, and the same tokens as plain decoding's
seeded draws."""

from __future__ import annotations

import pytest
import torch

from rhyme_sglang.cpu_backend.seeded import draw_key, seeded_sample_rows
from rhyme_sglang.cpu_backend.sampling import (
    VerifyFilters,
    sample_rows,
    sampling_impl,
    tree_speculative_sampling_target_only,
    verify_renorm,
)


def _run(probs, candidates, next_token, next_sibling, coins, final_coin, num_spec):
    """One request: probs [n, V]; returns (num_accepted, predicts list, accept_index list)."""
    n = len(candidates)
    predicts = torch.full((n,), -1, dtype=torch.int32)
    accept_index = torch.full((1, num_spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num,
        torch.tensor([candidates]), torch.arange(n).view(1, n),
        torch.tensor([next_token]), torch.tensor([next_sibling]),
        torch.tensor([coins], dtype=torch.float32), torch.tensor([final_coin]),
        probs.view(1, n, -1), torch.zeros(1, n, probs.shape[-1]),
    )
    return int(accept_num[0]), predicts.tolist(), accept_index[0].tolist()


P_ROOT = torch.tensor([0.5, 0.2, 0.2, 0.1])
P_NODE1 = torch.tensor([0.1, 0.1, 0.3, 0.5])


def test_chain_accepts_the_child_holding_the_nodes_draw():
    probs = torch.stack([P_ROOT, P_NODE1])
    # chain root -> node1 (token 1); P_ROOT's CDF [.5, .7, .9, 1.0]
    acc, pred, idx = _run(probs, [9, 1], [1, -1], [-1, -1], [0.6, 0.0], 0.0, num_spec=2)
    assert acc == 1 and pred[0] == 1 and idx == [0, 1]
    acc, pred, idx = _run(probs, [9, 1], [1, -1], [-1, -1], [0.4, 0.0], 0.0, num_spec=2)
    assert acc == 0 and idx == [0, -1]
    assert pred[0] == 0  # the root's draw is the bonus


def test_bonus_after_full_acceptance_is_the_leafs_draw():
    probs = torch.stack([P_ROOT, P_NODE1])
    # coin 0.95 into P_NODE1's CDF [0.1, 0.2, 0.5, 1.0] -> token 3
    acc, pred, _ = _run(probs, [9, 1], [1, -1], [-1, -1], [0.6, 0.95], 0.0, num_spec=2)
    assert acc == 1 and pred[1] == 3
    # num_spec 1: no draft may be accepted, the root's draw is emitted
    acc, pred, _ = _run(probs, [9, 1], [1, -1], [-1, -1], [0.6, 0.95], 0.0, num_spec=1)
    assert acc == 0 and pred[0] == 1


def test_siblings_accept_whichever_holds_the_draw():
    probs = torch.stack([P_ROOT, P_NODE1, P_NODE1])
    # root has children node1 (token 0) and node2 (token 2)
    tree = dict(candidates=[9, 0, 2], next_token=[1, -1, -1], next_sibling=[-1, 2, -1])
    acc, pred, idx = _run(probs, coins=[0.8, 0, 0], final_coin=0.0, num_spec=2, **tree)
    assert acc == 1 and idx[1] == 2 and pred[0] == 2  # 0.7 <= 0.8 < 0.9
    acc, pred, idx = _run(probs, coins=[0.3, 0, 0], final_coin=0.0, num_spec=2, **tree)
    assert acc == 1 and idx[1] == 1 and pred[0] == 0
    acc, pred, idx = _run(probs, coins=[0.95, 0, 0], final_coin=0.0, num_spec=2, **tree)
    assert acc == 0 and pred[0] == 3  # no child holds token 3: it is the bonus


@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_token_distribution_is_exactly_target(seed):
    """Monte Carlo over coins: the first emitted token is distributed as p_root."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.stack([P_ROOT, P_NODE1, P_NODE1])
    tree = dict(candidates=[9, 1, 3], next_token=[1, -1, -1], next_sibling=[-1, 2, -1])
    trials = 20000
    counts = torch.zeros(4)
    for _ in range(trials):
        coins = torch.rand(3, generator=gen).tolist()
        final = float(torch.rand(1, generator=gen))
        acc, pred, _ = _run(probs, coins=coins, final_coin=final, num_spec=2, **tree)
        counts[pred[0]] += 1
    freq = counts / trials
    assert torch.allclose(freq, P_ROOT, atol=0.012), freq


def test_lossy_thresholds_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        tree_speculative_sampling_target_only(
            torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), torch.zeros(1),
            torch.zeros(1, 2, 4), None, threshold_single=0.9,
        )


def test_seeded_draws_are_exact_fixed_and_differ_by_seed_and_position():
    """The race draws each row's tokens with their probabilities, head (raced token by token)
    and tail (raced as one block, then within) alike: 40000 keys over a row whose tail holds
    ~30% of the mass in 1000 tokens below the head's floor."""
    head = torch.tensor([0.3, 0.2, 0.1, 0.05, 0.05])
    tail = torch.full((1000,), 0.3 / 1000)  # each below 2^-12 of the mass
    probs = torch.cat([head, tail])[None] * 3.0  # rows need not be normalised
    trials = 40000
    draws = seeded_sample_rows(probs.expand(trials, -1), list(range(trials)), [9] * trials).view(-1)
    counts = torch.bincount(draws, minlength=probs.shape[1]).double()
    expected = torch.cat([head, tail.sum().view(1)]) * trials
    observed = torch.cat([counts[:5], counts[5:].sum().view(1)])
    assert bool(((observed - expected).abs() < 5 * expected.sqrt()).all()), (observed, expected)
    assert counts[5:].max() < 40  # the tail's own race spreads over its tokens (mean 12)
    again = seeded_sample_rows(probs.expand(50, -1), list(range(50)), [9] * 50).view(-1)
    assert again.tolist() == draws[:50].tolist()  # a key fixes its draw
    other = seeded_sample_rows(probs.expand(50, -1), list(range(50)), [10] * 50).view(-1)
    assert other.tolist() != again.tolist()
    assert draw_key(-3, 0) == draw_key(-3 + (1 << 64), 0)  # seeds are 64-bit
    zero = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    assert seeded_sample_rows(zero, [1, 2], [3, 4]).view(-1).tolist() == [1, 2]
    with pytest.raises(ValueError, match="2 seeds and 1 positions for 2 rows"):
        seeded_sample_rows(zero, [1, 2], [3])
    with pytest.raises(ValueError, match="batch, vocab"):
        seeded_sample_rows(torch.ones(3), [1], [1])


def test_seeded_draws_survive_the_rounding_that_moves_inverse_cdf_draws():
    """Rows of a 49k vocabulary shaped like a language model's at temperature 1.0, and the
    same rows with every probability moved by ~1e-6 relative (what another kernel's rounding
    does): no seeded draw moves, while the vocabulary-order inverse CDF with the same coins
    moves some."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(400, 49152, generator=gen) * 2.0
    logits[:, :50] += 9.0  # a head of likely tokens and a long tail
    probs = torch.softmax(logits, -1)
    moved = torch.softmax(logits + torch.randn(logits.shape, generator=gen) * 1e-6 * logits.abs(), -1)
    seeds, positions = list(range(400)), [17] * 400
    a, b = seeded_sample_rows(probs, seeds, positions), seeded_sample_rows(moved, seeds, positions)
    assert int((a != b).sum()) == 0
    flips = 0
    for trial in range(10):
        coins = torch.rand(400, dtype=torch.float64, generator=gen)
        flips += int((sample_rows(probs, coins) != sample_rows(moved, coins)).sum())
    assert flips > 0


def test_request_seeds_are_the_users_or_one_random_draw_kept_per_request():
    from types import SimpleNamespace

    from rhyme_sglang.cpu_backend.seeded import request_seed

    def req(rid, seed=None):
        return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(sampling_seed=seed))

    assert request_seed(req("a", seed=-7)) == -7
    torch.manual_seed(0)
    a, b = req("a"), req("b")
    seeds = [request_seed(a), request_seed(b)]
    assert request_seed(a) == seeds[0] and seeds[0] != seeds[1]  # kept on the request
    assert all(0 <= x < 2**63 for x in seeds)
    torch.manual_seed(0)  # another engine with the same --random-seed: other rids, other seeds
    assert request_seed(req("c")) not in seeds
    torch.manual_seed(0)
    assert request_seed(req("a")) == seeds[0]  # same generator, same rid: reproducible


def _seeded_walk(probs, candidates, next_token, seeds, starts, num_spec):
    """The walk of a batch of chains [bs, n] with seeded coins (as inside the verify)."""
    from rhyme_sglang.cpu_backend import sampling

    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    rule = VerifyFilters(None, None, None, n, seeds=seeds, starts=starts)
    token = sampling._FILTERS.set(rule)
    try:
        tree_speculative_sampling_target_only(
            predicts, accept_index, accept_num, candidates, torch.arange(bs * n).view(bs, n),
            next_token, torch.full((bs, n), -1), torch.zeros(bs, n), torch.zeros(bs), probs)
    finally:
        sampling._FILTERS.reset(token)
    emitted = []
    for b in range(bs):
        path = [i for i in accept_index[b].tolist() if i >= 0]
        emitted.append([int(predicts[i]) for i in path])
    return emitted, accept_num.tolist()


def test_a_seeded_verify_emits_plain_decodings_seeded_draws():
    """Whatever the drafts, a seeded verify emits the tokens plain decoding draws with the
    same seeds at the same positions (seeded_sample_rows), up to the first draft
    that differs from them, and then that position's plain draw."""
    gen = torch.Generator().manual_seed(3)
    bs, n, vocab = 4, 5, 50
    probs = torch.softmax(torch.randn(bs, n, vocab, generator=gen) * 1.5, -1)
    seeds, starts = [11, -4, 11, 2**62], [7, 30, 8, 0]
    plain = [[int(seeded_sample_rows(probs[b, d][None], [seeds[b]], [starts[b] + d]))
              for d in range(n)] for b in range(bs)]
    chain = torch.tensor([[1, 2, 3, 4, -1]] * bs)
    # drafts equal to the plain draws: every draft accepted, the bonus is the leaf's draw
    drafts = torch.tensor([[0] + plain[b][: n - 1] for b in range(bs)])
    emitted, accepted = _seeded_walk(probs, drafts, chain, seeds, starts, num_spec=n)
    assert accepted == [n - 1] * bs and emitted == plain
    # a wrong draft at depth 2: two accepted, then the plain draw of that position
    wrong = drafts.clone()
    wrong[:, 3] = (wrong[:, 3] + 1) % vocab
    emitted, accepted = _seeded_walk(probs, wrong, chain, seeds, starts, num_spec=n)
    assert accepted == [2] * bs and emitted == [p[:3] for p in plain]


def test_sample_rows_draws_each_row_from_its_own_distribution():
    """Chi-square against the exact distribution, per row; rows unnormalised, with zeros and a
    token of tiny mass among large ones."""
    from tests.helpers import goodness_of_fit_pvalue

    torch.manual_seed(0)
    rows = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0],
                         [0.0, 3.0, 0.0, 1.0, 0.0],   # unnormalised: mass 4
                         [0.02, 0.0, 0.0, 0.0, 0.98]])
    draws = torch.cat([sample_rows(rows) for _ in range(4000)], dim=1)  # [3, 4000]
    assert draws.dtype == torch.int64
    for row, sample in zip(rows, draws.tolist()):
        exact = {k: float(p / row.sum()) for k, p in enumerate(row.tolist()) if p > 0}
        assert goodness_of_fit_pvalue(sample, exact) > 1e-4, (row, exact)


def test_sample_rows_never_picks_zero_mass_even_at_the_largest_coin(monkeypatch):
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0], [0.4, 0.6, 0.0, 0.0, 0.0]])
    largest = 1.0 - 2.0 ** -53  # the largest double torch.rand can return
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, largest, **kw))
    assert sample_rows(probs).view(-1).tolist() == [2, 1]
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, **kw))
    assert sample_rows(probs).view(-1).tolist() == [1, 0]


def test_sample_rows_matches_multinomial_shape_and_refuses_bad_shapes():
    probs = torch.softmax(torch.randn(7, 49152), dim=-1)
    assert sample_rows(probs).shape == torch.multinomial(probs, 1).shape == (7, 1)
    with pytest.raises(ValueError, match="batch, vocab"):
        sample_rows(torch.ones(3))


def test_sampling_impl_env_is_checked(monkeypatch):
    monkeypatch.delenv("RHYME_CPU_SAMPLING", raising=False)
    assert sampling_impl() == "inverse_cdf"
    monkeypatch.setenv("RHYME_CPU_SAMPLING", "torch")
    assert sampling_impl() == "torch"
    monkeypatch.setenv("RHYME_CPU_SAMPLING", "fast")
    with pytest.raises(ValueError, match="'fast'"):
        sampling_impl()


def test_verify_probs_rows_equal_the_dense_probabilities_and_verify_alike():
    """sglang's verify path on CPU: softmax (patched to VerifyProbs), renorms, reshape,
    zeros_like, then the tree walk. Rows computed when read equal the dense filtered ones, and
    the walk emits the same tokens with the same coins."""
    from rhyme_sglang.cpu_backend import sampling
    from rhyme_sglang.cpu_backend.sampling import VerifyProbs, filter_row

    gen = torch.Generator().manual_seed(3)
    bs, n, vocab = 3, 4, 50
    logits = torch.randn(bs * n, vocab, generator=gen) * 3
    temps = torch.tensor([[0.7], [1.0], [1.3]]).repeat_interleave(n, dim=0)
    ks, ps = [5, 0, 50], [0.9, 1.0, 0.5]  # per request
    filters = VerifyFilters(ks, ps, None, n)

    def softmax(x, temperatures=None):
        return torch.softmax(x / temperatures, dim=-1)

    token = sampling._FILTERS.set(filters)
    try:
        lazy = VerifyProbs(logits, temps, softmax, filters)
        assert verify_renorm(verify_renorm(lazy, torch.tensor(ks)), torch.tensor(ps)) is lazy
    finally:
        sampling._FILTERS.reset(token)
    assert torch.zeros_like(lazy) is None
    dense = torch.stack([filter_row(softmax(logits[r], temps[r]), ks[r // n], ps[r // n])
                         for r in range(bs * n)])
    lazy = lazy.reshape(bs, n, -1)
    assert lazy.shape == (bs, n, vocab)
    for b in range(bs):
        for node in range(n):
            torch.testing.assert_close(lazy[b, node], dense[b * n + node], rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="row reads only"):
        torch.sum(lazy)
    # the same walk with the same coins: chains 0 -> 1 -> 2 -> 3 of each row's argmax tokens
    candidates = dense.view(bs, n, -1).argmax(-1)
    candidates = torch.cat([candidates[:, :1], candidates[:, :-1]], dim=1)
    outs = []
    for probs in (VerifyProbs(logits, temps, softmax, filters).reshape(bs, n, -1),
                  dense.view(bs, n, -1)):
        predicts = torch.full((bs * n,), -1, dtype=torch.int32)
        accept_index = torch.full((bs, n), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        tree_speculative_sampling_target_only(
            predicts, accept_index, accept_num, candidates,
            torch.arange(bs * n).view(bs, n), torch.tensor([[1, 2, 3, -1]] * bs),
            torch.full((bs, n), -1), torch.rand(bs, n, generator=torch.Generator().manual_seed(5)),
            torch.rand(bs, generator=torch.Generator().manual_seed(6)), probs, None)
        outs.append((predicts.tolist(), accept_index.tolist(), accept_num.tolist()))
    assert outs[0] == outs[1]


def test_verify_ops_refuse_to_run_outside_a_verify():
    from rhyme_sglang.cpu_backend.sampling import lazy_verify_softmax

    with pytest.raises(RuntimeError, match="inside a verify only"):
        lazy_verify_softmax(torch.softmax)(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="inside a verify only"):
        verify_renorm(torch.full((2, 5), 0.2), torch.tensor([2, 2]))


# ---- verify filters: the target rows plain decoding samples from -------------------------
def _plain_decoding_row(probs, k, p, min_p):
    """The row sglang's torch sampler draws from (its own filter, weights put back in place)."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    vocab = probs.numel()
    _, kept, order, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone()[None], torch.tensor([k if k else vocab]), torch.tensor([p if p else 1.0]),
        torch.tensor([min_p or 0.0]), bool(min_p), None, torch.zeros(1, dtype=torch.long),
        return_filtered_probs=True)
    out = torch.zeros(vocab).scatter_(0, order[0].long(), kept[0])
    return out / out.sum()


def test_filter_row_is_plain_decodings_joint_rule():
    """top-k, top-p over the unfiltered mass and min-p, as one rule: equal to sglang's torch
    sampler's own filter and to the tests' reference, on random rows (peaked and flat, a 49k
    vocabulary for rows the first 128-token head does not decide)."""
    from rhyme_sglang.cpu_backend.sampling import filter_row
    from tests.helpers import filtered_probs

    gen = torch.Generator().manual_seed(11)
    cases = 0
    for vocab, scale in ((300, 4.0), (300, 0.5), (49152, 0.3)):
        for _ in range(12):
            logits = torch.randn(vocab, generator=gen) * scale
            probs = torch.softmax(logits, -1)
            k = [None, 1, 3, 20, 200, 100000][int(torch.randint(0, 6, (1,), generator=gen))]
            p = [None, 0.3, 0.9, 0.999][int(torch.randint(0, 4, (1,), generator=gen))]
            m = [None, 0.02, 0.3, 1e-5][int(torch.randint(0, 4, (1,), generator=gen))]
            got = filter_row(probs, k, p, m)
            torch.testing.assert_close(got, _plain_decoding_row(probs, k, p, m), rtol=1e-5, atol=1e-7)
            ref = filtered_probs(logits[None], 1.0, k or -1, p or 1.0, m or 0.0)[0]
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
            cases += 1
    assert cases == 36
    probs = torch.softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), -1)
    assert filter_row(probs) is probs  # no filter: the row as it is


def _sglang_verify_row(probs, k, p):
    """sglang's own verify filter: top-k renormalised, then top-p over the renormalised mass
    (no min-p)."""
    vals, idx = torch.sort(probs, descending=True)
    vals = torch.where(torch.arange(vals.numel()) < k, vals, torch.zeros_like(vals))
    vals = vals / vals.sum()
    vals = torch.where(torch.cumsum(vals, 0) - vals > p, torch.zeros_like(vals), vals)
    out = torch.zeros_like(probs).scatter_(0, idx, vals)
    return out / out.sum()


def _fake_verify(logits, temps, info, nodes):
    """What sglang's eagle_sample does to its target probabilities, inside the wrapper."""
    from types import SimpleNamespace

    from rhyme_sglang.cpu_backend.sampling import (lazy_verify_softmax,
                                                   with_verify_filters)

    def softmax(x, temperatures=None):
        return torch.softmax(x / temperatures, dim=-1)

    def eagle_sample(verify_input, batch):
        probs = lazy_verify_softmax(softmax)(logits, temperatures=temps)
        if batch.sampling_info.need_top_k_sampling:
            probs = verify_renorm(probs, batch.sampling_info.top_ks.repeat_interleave(nodes))
        if batch.sampling_info.need_top_p_sampling:
            probs = verify_renorm(probs, batch.sampling_info.top_ps.repeat_interleave(nodes))
        bs = logits.shape[0] // nodes
        probs = probs.reshape(bs, nodes, -1)
        return [probs[b, j].clone() for b in range(bs) for j in range(nodes)]

    return with_verify_filters(eagle_sample)(SimpleNamespace(draft_token_num=nodes),
                                             SimpleNamespace(sampling_info=info))


@pytest.mark.parametrize("impl", ["inverse_cdf", "torch"])
def test_verify_target_rows_are_filtered_as_plain_decoding(impl, monkeypatch):
    """Inside the verify (``with_verify_filters``), lazy rows and the dense tensor (the
    ``RHYME_CPU_SAMPLING=torch`` path) alike: each request's rows are its plain-decoding
    distribution (top-k with top-p jointly, min-p), whatever renorm calls sglang makes after."""
    from types import SimpleNamespace

    from rhyme_sglang.cpu_backend import sampling

    monkeypatch.setenv("RHYME_CPU_SAMPLING", impl)
    gen = torch.Generator().manual_seed(4)
    bs, nodes, vocab = 3, 3, 120
    logits = torch.randn(bs * nodes, vocab, generator=gen) * 2.5
    temps = torch.tensor([[0.8], [1.0], [1.2]]).repeat_interleave(nodes, dim=0)
    ks, ps, mins = [10, 1 << 30, 40], [0.5, 0.9, 1.0], [0.05, 0.0, 0.2]
    info = SimpleNamespace(need_top_k_sampling=True, top_ks=torch.tensor(ks),
                           need_top_p_sampling=True, top_ps=torch.tensor(ps),
                           need_min_p_sampling=True, min_ps=torch.tensor(mins))
    rows = _fake_verify(logits, temps, info, nodes)
    sequential = 0
    for r, row in enumerate(rows):
        b = r // nodes
        probs = torch.softmax(logits[r] / temps[r], -1)
        torch.testing.assert_close(row, _plain_decoding_row(probs, ks[b], ps[b], mins[b]),
                                   rtol=1e-5, atol=1e-7)
        old = _sglang_verify_row(probs, ks[b], ps[b])
        sequential += int(not torch.allclose(row, old, atol=1e-6))
    assert sequential >= nodes  # sglang's own order (and no min-p) gives other rows
    assert sampling._FILTERS.get() is None  # the context ends with the verify
