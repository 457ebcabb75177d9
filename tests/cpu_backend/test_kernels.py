"""Stand-in ops against straightforward references (and sglang's own host reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rhyme_sglang.cpu_backend import attention, cache_ops, tree_ops


def _random_tree_mask(rng, n):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask, parent


@pytest.mark.parametrize("seed", range(5))
def test_reconstruct_indices_matches_parent_structure(seed):
    rng = np.random.default_rng(seed)
    bs, n = 3, 6
    masks, parents = zip(*[_random_tree_mask(rng, n) for _ in range(bs)])
    flat = torch.from_numpy(np.stack(masks).reshape(-1))
    seq = torch.tensor([10, 20, 30])
    pos = torch.empty(bs * n, dtype=torch.long)
    ri, rn, rs = (torch.empty(bs, n, dtype=torch.long) for _ in range(3))
    tree_ops.reconstruct_indices_from_tree_mask(flat, seq, pos, ri, rn, rs, bs, n)
    for b in range(bs):
        par = parents[b]
        for i in range(n):
            depth, j = 0, par[i]
            while j >= 0:
                depth, j = depth + 1, par[j]
            assert pos[b * n + i] == seq[b] + depth
            children = [k for k in range(n) if par[k] == i]
            assert rn[b, i] == (children[0] if children else -1)
            sibs = [k for k in range(i + 1, n) if par[i] >= 0 and par[k] == par[i]]
            assert rs[b, i] == (sibs[0] if sibs else -1)
        assert ri[b].tolist() == [b * n + i for i in range(n)]


@pytest.mark.sglang
def test_reconstruct_indices_matches_sglang_host_reference():
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    rng = np.random.default_rng(7)
    bs, n = 4, 8
    mask = np.stack([_random_tree_mask(rng, n)[0] for _ in range(bs)])
    ref_next, ref_sib = _derive_tree_links(mask.reshape(-1), bs, n)
    pos = torch.empty(bs * n, dtype=torch.long)
    ri, rn, rs = (torch.empty(bs, n, dtype=torch.long) for _ in range(3))
    tree_ops.reconstruct_indices_from_tree_mask(
        torch.from_numpy(mask.reshape(-1)), torch.zeros(bs, dtype=torch.long), pos, ri, rn, rs, bs, n
    )
    assert torch.equal(rn, ref_next) and torch.equal(rs, ref_sib)


def test_verify_tree_greedy_follows_target_argmax():
    # root(0) -> {1: tok 5, 2: tok 6}; 2 -> 3: tok 7
    cand = torch.tensor([[4, 5, 6, 7]])
    nxt = torch.tensor([[1, -1, 3, -1]])
    sib = torch.tensor([[-1, 2, -1, -1]])
    target = torch.tensor([[6, 0, 7, 8]])  # argmax after root=6, after node2=7, after node3=8
    predicts = torch.full((4,), -1, dtype=torch.int32)
    acc_idx = torch.full((1, 3), -1, dtype=torch.int32)
    acc_num = torch.zeros(1, dtype=torch.int32)
    tree_ops.verify_tree_greedy_cpu(predicts, acc_idx, acc_num, cand, torch.arange(4).view(1, 4),
                                    nxt, sib, target)
    assert acc_num.tolist() == [2] and acc_idx.tolist() == [[0, 2, 3]]
    assert predicts[0] == 6 and predicts[2] == 7 and predicts[3] == 8


def _naive_attention(q, k, v, scale, mask):
    h, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hkv, 1)
    v = v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_extend_and_decode_attention_match_naive():
    torch.manual_seed(0)
    H, HKV, D, pool = 4, 2, 8, 64
    kbuf, vbuf = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
    req_to_token = torch.randperm(pool)[:40].view(2, 20).int()
    prefix, ext = 5, 3
    q = torch.randn(ext, H, D)
    k, v = torch.randn(ext, HKV, D), torch.randn(ext, HKV, D)
    locs = req_to_token[1, : prefix + ext].long()
    kbuf[locs[prefix:]], vbuf[locs[prefix:]] = k, v
    o = torch.empty(ext, H, D)
    attention.extend_attention_cpu(
        q, k, v, o, kbuf, vbuf, 1.0, 1.0, req_to_token, torch.tensor([1]),
        torch.tensor([prefix + ext]), torch.tensor([ext]), torch.tensor([0]), ext, 0.3, 0.0,
        False, 0, None, None, None, True,
    )
    causal = torch.ones(ext, prefix + ext, dtype=torch.bool)
    causal[:, prefix:] = torch.ones(ext, ext, dtype=torch.bool).tril()
    ref = _naive_attention(q, kbuf[locs], vbuf[locs], 0.3, causal)
    assert torch.allclose(o, ref, atol=1e-5)
    # tree mask: token 2 sees only token 0 and itself
    tm = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    attention.extend_attention_cpu(
        q, k, v, o, kbuf, vbuf, 1.0, 1.0, req_to_token, torch.tensor([1]),
        torch.tensor([prefix + ext]), torch.tensor([ext]), torch.tensor([0]), ext, 0.3, 0.0,
        False, 0, None, None, tm.reshape(-1), True,
    )
    full = torch.cat([torch.ones(ext, prefix, dtype=torch.bool), tm], 1)
    assert torch.allclose(o, _naive_attention(q, kbuf[locs], vbuf[locs], 0.3, full), atol=1e-5)
    # decode: writes the new K/V, then attends over the whole row
    qd, kd, vd = torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    od = torch.empty(1, H, D)
    loc = req_to_token[0, 6:7].long()
    attention.decode_attention_cpu(
        qd, kbuf, vbuf, 1.0, 1.0, od, kd, vd, loc, None, req_to_token, torch.tensor([0]),
        torch.tensor([7]), 0.3, 0.0, False, 0, None, None,
    )
    assert torch.equal(kbuf[loc], kd)
    row = req_to_token[0, :7].long()
    ref = _naive_attention(qd, kbuf[row], vbuf[row], 0.3, torch.ones(1, 7, dtype=torch.bool))
    assert torch.allclose(od, ref, atol=1e-5)


def test_attention_unsupported_features_raise_naming_the_op():
    with pytest.raises(NotImplementedError, match="decode_attention_cpu.*sliding"):
        attention.decode_attention_cpu(
            torch.zeros(1, 1, 2), torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), 1.0, 1.0,
            torch.zeros(1, 1, 2), None, None, torch.tensor([0]), None,
            torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]), torch.tensor([1]),
            1.0, 0.0, False, 16, None, None,
        )


def test_cache_index_ops_round_trip():
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    locs = torch.arange(100, 107)
    rows, start, end = torch.tensor([2, 0]), torch.tensor([1, 4]), torch.tensor([4, 8])
    cache_ops.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 10)
    assert req_to_token[2, 1:4].tolist() == [100, 101, 102]
    assert req_to_token[0, 4:8].tolist() == [103, 104, 105, 106]
    out = torch.empty(7, dtype=torch.long)
    cache_ops.assign_extend_cache_locs_cpu(rows, req_to_token, start, end, out, 10)
    assert out.tolist() == locs.tolist()
    acc = torch.tensor([[0, 2, -1], [3, -1, -1]])
    packed = torch.zeros(6, dtype=torch.long)
    cache_ops.fill_accept_out_cache_loc_cpu(acc, torch.arange(50, 56), packed)
    assert packed[:3].tolist() == [50, 52, 53]
    bonus = torch.zeros(2, dtype=torch.long)
    cache_ops.fill_bonus_tokens_cpu(torch.tensor([7, 8, 9, 4, 5, 6]), torch.tensor([2, 1]), bonus, 3)
    assert bonus.tolist() == [8, 4]


def test_cache_index_ops_match_a_per_request_loop():
    """The packed index ops (one gather / scatter for the batch) against the kernel's
    per-request loop, on random batches: empty segments, 1-17 slots, any row order, and
    segments that end before they start (no cell, and the packed slots of the segments after
    them move back, as in the kernel). Where that makes packed slots overlap, only the
    table write (which reads them) is compared: the kernel's own writes would race there."""
    gen = torch.Generator().manual_seed(0)
    checked_back = 0
    for case in range(300):
        bs = int(torch.randint(1, 40, (1,), generator=gen))
        rows = torch.randperm(64, generator=gen)[:bs]
        start = torch.randint(8, 100, (bs,), generator=gen)
        end = start + torch.randint(0, 18, (bs,), generator=gen)
        if case % 3 == 2:  # segments that end before they start, anywhere in the batch
            back = torch.rand(bs, generator=gen) < 0.3
            end[back] = start[back] - torch.randint(1, 4, (int(back.sum()),), generator=gen)
        offs = (torch.cumsum(end - start, 0) - (end - start)).tolist()
        if min(offs) < 0:
            continue
        total = max(int(o + max(e - s, 0)) for o, s, e in zip(offs, start.tolist(), end.tolist()))
        locs = torch.randint(0, 10**6, (max(total, 1),), generator=gen)
        table = torch.randint(0, 10**6, (64, 128), dtype=torch.int32, generator=gen)
        want_table, want_out = table.clone(), torch.full((max(total, 1),), -7, dtype=torch.long)
        written, overlap = set(), False
        for r, s, e, off in zip(rows.tolist(), start.tolist(), end.tolist(), offs):
            if e > s:
                want_table[r, s:e] = locs[off:off + e - s].to(torch.int32)
                want_out[off:off + e - s] = want_table[r, s:e].long()
                slots = set(range(off, off + e - s))
                overlap |= bool(slots & written)
                written |= slots
        checked_back += int(bool((end < start).any()))
        got_table = table.clone()
        cache_ops.assign_req_to_token_pool_cpu(rows, got_table, start, end, locs, 128)
        assert torch.equal(got_table, want_table)
        if not overlap:
            got_out = torch.full_like(want_out, -7)
            cache_ops.assign_extend_cache_locs_cpu(rows, got_table, start, end, got_out, 128)
            assert torch.equal(got_out, want_out)
    assert checked_back >= 30


@pytest.mark.parametrize("native", [True, False])
def test_copy_all_layer_kv_cache_moves_rows_by_pointer(native, monkeypatch):
    """Native (one call for every buffer) and PyTorch paths alike; sources are read before
    targets are written, so overlapping sets move as a gather then a scatter."""
    from rhyme_sglang.cpu_backend import attention

    if native and attention._native is None:
        pytest.skip("_rhyme_attention is not built")
    if not native:
        monkeypatch.setattr(cache_ops, "_native", None)
    bufs = [torch.arange(40, dtype=torch.float32).view(10, 4).clone() for _ in range(2)]
    bufs.append(torch.arange(20, dtype=torch.bfloat16).view(10, 2).clone())  # another row size
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    cache_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([8, 9]))
    for b in bufs[:2]:
        assert b[1].tolist() == [32, 33, 34, 35] and b[2].tolist() == [36, 37, 38, 39]
    assert bufs[2][1].tolist() == [16, 17] and bufs[2][2].tolist() == [18, 19]
    cache_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([4, 5]), torch.tensor([5, 6]))
    assert bufs[0][4].tolist() == [20, 21, 22, 23] and bufs[0][5].tolist() == [24, 25, 26, 27]
    with pytest.raises(ValueError):
        cache_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1]), torch.tensor([2, 3]))
