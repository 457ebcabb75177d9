"""The batched CPU attention ops against the per-request reference loop they replaced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rhyme_sglang.cpu_backend import attention
from tests.cpu_backend.helpers import attention_impl, paged_cache, random_tree
from tests.cpu_backend.reference_attention import decode_attention_ref, extend_attention_ref

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# the native paged kernel when it is built, and the batched PyTorch ops
IMPLS = ["torch"] + (["native"] if attention._native is not None else [])
needs_native = pytest.mark.skipif(attention._native is None, reason="native attention not built")


def _heads(draw):
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    v_dim = draw(st.sampled_from([head_dim, 6]))
    return kv_heads * group, kv_heads, head_dim, v_dim


def _run_extend(op, case, k, v, out_rows):
    o = torch.zeros(out_rows, case["q"].shape[1], case["v_dim"], dtype=case["q"].dtype)
    op(case["q"], k, v, o, case["k_buffer"], case["v_buffer"], 1.0, 1.0, case["req_to_token"],
       case["rows"], case["seq_lens"], case["ext_lens"], case["starts"], max(case["ext"]),
       case["scale"], case["cap"], False, 0, None, None, case["tree"], case["causal"])
    return o


def _extend_case(draw, uniform_tree: bool, ragged_tree: bool = False):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(DTYPES)
    heads, kv_heads, head_dim, v_dim = _heads(draw)
    bsz = draw(st.integers(1, 4))
    prefix = draw(st.lists(st.integers(0, 9), min_size=bsz, max_size=bsz))
    if ragged_tree:  # RHYME's ragged verify: [bs, n, n] trees, request b runs its first ext[b]
        n = draw(st.integers(1, 6))
        ext = draw(st.lists(st.integers(1, n), min_size=bsz, max_size=bsz))
        tree = torch.stack([random_tree(gen, n) for _ in range(bsz)])
    elif uniform_tree:
        n = draw(st.integers(1, 5))
        ext = [n] * bsz
        tree = torch.stack([random_tree(gen, n) for _ in range(bsz)]).reshape(-1)
    else:
        ext = draw(st.lists(st.integers(0, 5), min_size=bsz, max_size=bsz).filter(any))
        tree = None
    seq = [p + e for p, e in zip(prefix, ext)]
    seq = [max(s, 1) for s in seq]  # a request with nothing cached still owns one token
    prefix = [s - e for s, e in zip(seq, ext)]
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, kv_heads, head_dim, v_dim, dtype)
    tokens = sum(ext)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, v_dim, generator=gen).to(dtype)
    ext_t = torch.tensor(ext, dtype=torch.int32)
    case = dict(
        q=torch.randn(tokens + 2, heads, head_dim, generator=gen).to(dtype),  # 2 padding rows
        k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, rows=rows,
        seq_lens=torch.tensor(seq), ext_lens=ext_t, starts=torch.cumsum(ext_t, 0) - ext_t,
        ext=ext, v_dim=v_dim, tree=tree, scale=draw(st.sampled_from([0.3, 1.0])),
        cap=draw(st.sampled_from([0.0, 0.0, 2.0])), causal=draw(st.booleans()) if tree is None else True,
    )
    # the extend tokens' K/V are already in the cache (sglang writes them before the op)
    start = 0
    for row, p, e in zip(rows.tolist(), prefix, ext):
        locs = req_to_token[row, p : p + e].long()
        k_buffer[locs], v_buffer[locs] = k[start : start + e], v[start : start + e]
        start += e
    return case, k, v, dtype


def _check_extend(case, k, v, dtype):
    rows = case["q"].shape[0]
    got = _run_extend(attention.extend_attention_cpu, case, k, v, rows)
    want = _run_extend(extend_attention_ref, case, k, v, rows)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    # KV-shared layers pass k = v = None and read the extend K/V from the cache
    shared = _run_extend(attention.extend_attention_cpu, case, None, None, rows)
    torch.testing.assert_close(shared.float(), want.float(), **TOLERANCE[dtype])
    assert not got[sum(case["ext"]) :].any(), "padding rows of o must stay untouched"


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(st.data())
def test_ragged_extend_matches_reference(impl, data):
    with attention_impl(impl):
        _check_extend(*_extend_case(data.draw, uniform_tree=False))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(st.data())
def test_tree_verify_matches_reference(impl, data):
    with attention_impl(impl):
        _check_extend(*_extend_case(data.draw, uniform_tree=True))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(st.data())
def test_ragged_tree_verify_matches_reference(impl, data):
    """Requests of one verify run different numbers of their tree's nodes (the top-left block
    of each ``[n, n]`` tree)."""
    with attention_impl(impl):
        _check_extend(*_extend_case(data.draw, uniform_tree=False, ragged_tree=True))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(st.data())
def test_decode_matches_reference_and_writes_the_new_kv(impl, data):
    with attention_impl(impl):
        _check_decode(data.draw)


def _check_decode(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(DTYPES)
    heads, kv_heads, head_dim, v_dim = _heads(draw)
    seq = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
    bsz = len(seq)
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, kv_heads, head_dim, v_dim, dtype)
    q = torch.randn(bsz, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(bsz, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(bsz, kv_heads * v_dim, generator=gen).to(dtype)
    last = torch.tensor([int(req_to_token[r, n - 1]) for r, n in zip(rows.tolist(), seq)])
    scale, cap = draw(st.sampled_from([0.3, 1.0])), draw(st.sampled_from([0.0, 0.0, 2.0]))
    outs, caches = [], []
    for op in (attention.decode_attention_cpu, decode_attention_ref):
        kb, vb = k_buffer.clone(), v_buffer.clone()
        o = torch.zeros(bsz, heads, v_dim, dtype=dtype)
        op(q, kb, vb, 1.0, 1.0, o, k, v, last, None, req_to_token, rows, torch.tensor(seq),
           scale, cap, False, 0, None, None)
        outs.append(o)
        caches.append((kb, vb))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **TOLERANCE[dtype])
    kb, vb = caches[0]
    assert torch.equal(kb[last], k.view(bsz, kv_heads, head_dim))
    assert torch.equal(vb[last], v.view(bsz, kv_heads, v_dim))
    untouched = torch.ones(k_buffer.shape[0], dtype=torch.bool)
    untouched[last] = False
    assert torch.equal(kb[untouched], k_buffer[untouched])


def _causal_case(gen, seq, ext, heads, dim, k_buffer, v_buffer, req_to_token, rows, scale):
    """A causal extend case (fp32, K/V already in the cache) in ``_run_extend``'s format."""
    ext_t = torch.tensor(ext, dtype=torch.int32)
    return dict(q=torch.randn(sum(ext), heads, dim, generator=gen), k_buffer=k_buffer,
                v_buffer=v_buffer, req_to_token=req_to_token, rows=rows, seq_lens=torch.tensor(seq),
                ext_lens=ext_t, starts=torch.cumsum(ext_t, 0) - ext_t, ext=ext, v_dim=dim,
                tree=None, scale=scale, cap=0.0, causal=True)


def test_chunked_batches_match_reference(monkeypatch):
    """One long request among short ones: the batch splits into chunks, results unchanged."""
    monkeypatch.setenv("RHYME_CPU_ATTENTION", "torch")  # chunking belongs to the PyTorch path
    gen = torch.Generator().manual_seed(3)
    seq = [200] + [3, 5, 4, 6, 2, 7]
    ext = [4, 1, 2, 0, 3, 1, 2]
    bsz, heads, kv_heads, dim = len(seq), 4, 2, 8
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, kv_heads, dim, dim, torch.float32)
    case = _causal_case(gen, seq, ext, heads, dim, k_buffer, v_buffer, req_to_token, rows, 0.5)
    want = _run_extend(extend_attention_ref, case, None, None, sum(ext))
    one_request = 200 * (4 * kv_heads * 2 * dim + 4 * 12 * heads)
    monkeypatch.setattr(attention, "CHUNK_BYTES", one_request)
    chunks = attention._chunks(
        attention._Requests(rows, case["seq_lens"], case["ext_lens"], case["starts"], None, 200, 4, False),
        seq, ext, 4 * kv_heads * 2 * dim, 12 * heads)
    assert len(chunks) == 2 and chunks[-1].max_seq == 200
    got = _run_extend(attention.extend_attention_cpu, case, None, None, sum(ext))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    q = torch.randn(bsz, heads, dim, generator=gen)
    outs = []
    for op in (attention.decode_attention_cpu, decode_attention_ref):
        o = torch.zeros(bsz, heads, dim)
        op(q, k_buffer, v_buffer, 1.0, 1.0, o, None, None, torch.zeros(bsz, dtype=torch.long), None,
           req_to_token, rows, torch.tensor(seq), 0.5, 0.0, False, 0, None, None)
        outs.append(o)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _tiny_extend_args(k_buffer, **overrides):
    args = dict(is_cross=False, sliding_window=0, sinks=None)
    args.update(overrides)
    q = torch.zeros(1, 1, 2)
    return (q, None, None, torch.zeros(1, 1, 2), k_buffer, torch.zeros(4, 1, 2), 1.0, 1.0,
            torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]), torch.tensor([1]),
            torch.tensor([1]), torch.tensor([0]), 1, 1.0, 0.0, args["is_cross"],
            args["sliding_window"], None, args["sinks"], None, True)


def _tiny_decode_args(k_buffer, **overrides):
    args = dict(is_cross=False, sliding_window=0, sinks=None)
    args.update(overrides)
    return (torch.zeros(1, 1, 2), k_buffer, torch.zeros(4, 1, 2), 1.0, 1.0, torch.zeros(1, 1, 2),
            None, None, torch.tensor([0]), None, torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([0]), torch.tensor([1]), 1.0, 0.0, args["is_cross"],
            args["sliding_window"], None, args["sinks"])


@pytest.mark.parametrize("op_name, build", [("extend_attention_cpu", _tiny_extend_args),
                                            ("decode_attention_cpu", _tiny_decode_args)])
@pytest.mark.parametrize("feature, overrides, fp8", [
    ("cross attention", dict(is_cross=True), False),
    ("sliding-window", dict(sliding_window=16), False),
    ("attention sinks", dict(sinks=torch.zeros(1)), False),
    ("fp8 KV cache", {}, True),
])
def test_unsupported_features_raise_naming_the_op(op_name, build, feature, overrides, fp8):
    k_buffer = torch.zeros(4, 1, 2, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
    with pytest.raises(NotImplementedError, match=f"{op_name}.*{feature}"):
        getattr(attention, op_name)(*build(k_buffer, **overrides))


def test_registered_ops_are_the_batched_ones():
    attention.register_torch_ops()
    gen = torch.Generator().manual_seed(0)
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, [5, 3], 1, 4, 4, torch.float32)
    q = torch.randn(2, 2, 4, generator=gen)
    args = (k_buffer, v_buffer, 1.0, 1.0)
    tail = (None, None, torch.tensor([0, 0]), torch.zeros(1), req_to_token, rows,
            torch.tensor([5, 3]), 0.5, 0.0, False, 0, None, None)
    via_torch, direct = torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)
    torch.ops.sgl_kernel.decode_attention_cpu(q, *args, via_torch, *tail)
    attention.decode_attention_cpu(q, *args, direct, *tail)
    assert torch.equal(via_torch, direct)


@needs_native
def test_native_splits_long_extends_to_the_torch_path():
    """A prefill longer than NATIVE_MAX_EXTEND beside short extends: both parts match."""
    gen = torch.Generator().manual_seed(5)
    ext = [attention.NATIVE_MAX_EXTEND + 6, 3, 1]
    seq = [e + p for e, p in zip(ext, [4, 7, 0])]
    heads, kv_heads, dim = 6, 2, 16
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, kv_heads, dim, dim, torch.float32)
    case = _causal_case(gen, seq, ext, heads, dim, k_buffer, v_buffer, req_to_token, rows, 0.25)
    want = _run_extend(extend_attention_ref, case, None, None, sum(ext))
    with attention_impl("native"):
        got = _run_extend(attention.extend_attention_cpu, case, None, None, sum(ext))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_native_tree_node_is_bit_identical_to_the_same_token_decoded(dtype, head_dim):
    """The lossless property of the native kernel: a verify-tree node's output equals, bit for
    bit, that of the same token decoded on its own after its accepted ancestors, whatever else
    shares either batch. (SDPA does not give this in bf16: its kernels round differently at one
    query row and at several.)"""
    gen = torch.Generator().manual_seed(11 + head_dim)
    heads, kv_heads, n, prefix = 6, 2, 7, 37
    parents = [-1, 0, 0, 1, 3, 2, 4]  # node i's parent < i
    tree = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        tree[i] |= tree[parents[i]]
    pool = 4096
    k_buffer = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k_new = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v_new = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    locs = torch.randperm(pool, generator=gen)
    prefix_locs, tree_locs = locs[:prefix], locs[prefix : prefix + n]
    other = 3  # a second request in the verify batch, with its own prefix and tree
    other_locs = locs[prefix + n : prefix + n + other + n]
    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    req_to_token[1, :prefix], req_to_token[1, prefix : prefix + n] = prefix_locs.int(), tree_locs.int()
    req_to_token[2, : other + n] = other_locs.int()
    k_buffer[tree_locs], v_buffer[tree_locs] = k_new, v_new
    q_other = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    kv_other = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    k_buffer[other_locs[other:]], v_buffer[other_locs[other:]] = kv_other
    with attention_impl("native"):
        o = torch.zeros(2 * n, heads, head_dim, dtype=dtype)
        attention.extend_attention_cpu(
            torch.cat([q_other, q]), torch.cat([kv_other[0], k_new]), torch.cat([kv_other[1], v_new]),
            o, k_buffer, v_buffer, 1.0, 1.0, req_to_token, torch.tensor([2, 1]),
            torch.tensor([other + n, prefix + n]), torch.tensor([n, n], dtype=torch.int32),
            torch.tensor([0, n]), n, 0.125, 0.0, False, 0, None, None,
            torch.stack([random_tree(gen, n), tree]).reshape(-1), True)
        verified = o[n:]
        for node in range(n):
            chain = [a for a in range(n) if tree[node, a]]  # ancestors and itself, in order
            # the plain engine's cache: the prefix, then the accepted ancestors at the next slots
            row = torch.zeros(1, 128, dtype=torch.int32)
            row[0, :prefix] = prefix_locs.int()
            row[0, prefix : prefix + len(chain)] = tree_locs[chain].int()
            table = torch.cat([torch.zeros(3, 128, dtype=torch.int32), row])
            out = torch.zeros(2, heads, head_dim, dtype=dtype)
            decode_q = torch.stack([torch.randn(heads, head_dim, generator=gen).to(dtype), q[node]])
            attention.decode_attention_cpu(
                decode_q, k_buffer, v_buffer, 1.0, 1.0, out, None, None, None, None, table,
                torch.tensor([2, 3]), torch.tensor([other + 2, prefix + len(chain)]), 0.125, 0.0,
                False, 0, None, None)
            assert torch.equal(out[1], verified[node]), f"tree node {node} differs from its decode"


def test_attention_choice_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("RHYME_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="RHYME_CPU_ATTENTION.*'fast'"):
        attention.native_enabled()
    monkeypatch.setenv("RHYME_CPU_ATTENTION", "torch")
    assert not attention.native_enabled()


@pytest.mark.parametrize("impl", IMPLS)
def test_query_rows_out_of_request_order(impl):
    """Requests whose query rows are not laid out in batch order (bf16: copied back by row)."""
    gen = torch.Generator().manual_seed(8)
    seq, ext = [9, 6], [3, 2]
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, 2, 8, 8, torch.bfloat16)
    ext_t = torch.tensor(ext, dtype=torch.int32)
    case = dict(q=torch.randn(7, 4, 8, generator=gen).to(torch.bfloat16), k_buffer=k_buffer,
                v_buffer=v_buffer, req_to_token=req_to_token, rows=rows, seq_lens=torch.tensor(seq),
                ext_lens=ext_t, starts=torch.tensor([4, 1]), ext=ext, v_dim=8, tree=None,
                scale=0.5, cap=0.0, causal=True)
    want = _run_extend(extend_attention_ref, case, None, None, 7)
    with attention_impl(impl):
        got = _run_extend(attention.extend_attention_cpu, case, None, None, 7)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[torch.bfloat16])
    assert not got[0].any() and not got[3].any(), "rows of no request stay untouched"


@needs_native
@pytest.mark.parametrize("seq", [[40, 7, 19, 33, 12], [57]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_results_do_not_depend_on_the_thread_count(seq, dtype):
    """Every bit is the same with 1, 3 or 8 threads: 1 runs each request whole; 3 and 8 (fewer
    than two requests a thread) split each request into its KV heads."""
    from rhyme_sglang.machine import set_kernel_threads

    gen = torch.Generator().manual_seed(21)
    n = 4
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, 2, 64, 64, dtype)
    bsz = len(seq)
    q = torch.randn(bsz * n, 6, 64, generator=gen).to(dtype)
    tree = torch.stack([random_tree(gen, n) for _ in range(bsz)]).reshape(-1)
    ext = torch.full((bsz,), n, dtype=torch.int32)
    outs = []
    try:
        for count in (1, 3, 8):
            set_kernel_threads(count)
            o = torch.zeros(bsz * n, 6, 64, dtype=dtype)
            with attention_impl("native"):
                attention.extend_attention_cpu(q, None, None, o, k_buffer, v_buffer, 1.0, 1.0,
                                               req_to_token, rows, torch.tensor(seq), ext,
                                               torch.arange(bsz) * n, n, 0.125, 0.0, False, 0,
                                               None, None, tree, True)
            outs.append(o)
    finally:
        set_kernel_threads(None)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_native
@pytest.mark.parametrize("k_dtype, cache_dtype", [(torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
def test_decode_stores_row_views_of_a_fused_projection(k_dtype, cache_dtype):
    """K/V given as row views of one [B, q + k + v] tensor (as the model's fused QKV output
    is split) land in the cache rows named by cache_loc, in the cache's dtype; the native copy
    takes them as they are, a dtype change goes through the index write."""
    gen = torch.Generator().manual_seed(11)
    seq, kv_heads, dim = [3, 7, 5], 2, 4
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, seq, kv_heads, dim, dim, cache_dtype)
    fused = torch.randn(3, 8 * dim + 2 * kv_heads * dim, generator=gen).to(k_dtype)
    q = fused[:, : 8 * dim].reshape(3, 8, dim)
    k, v = fused[:, 8 * dim : 8 * dim + kv_heads * dim], fused[:, 8 * dim + kv_heads * dim :]
    assert k.stride(0) == fused.shape[1] and not k.is_contiguous()
    last = torch.tensor([int(req_to_token[r, n - 1]) for r, n in zip(rows.tolist(), seq)])
    outs = []
    for op in (attention.decode_attention_cpu, decode_attention_ref):
        kb, vb = k_buffer.clone(), v_buffer.clone()
        o = torch.zeros(3, 8, dim, dtype=k_dtype)
        op(q, kb, vb, 1.0, 1.0, o, k, v, last, None, req_to_token, rows, torch.tensor(seq),
           0.5, 0.0, False, 0, None, None)
        outs.append((o, kb, vb))
    (o, kb, vb), (o_ref, kb_ref, vb_ref) = outs
    assert torch.equal(kb, kb_ref) and torch.equal(vb, vb_ref)
    assert torch.equal(kb[last], k.reshape(3, kv_heads, dim).to(cache_dtype))
    torch.testing.assert_close(o.float(), o_ref.float(), **TOLERANCE[cache_dtype])


@needs_native
def test_decode_store_rejects_a_location_outside_the_pool():
    k_buffer = torch.zeros(4, 1, 2)
    args = list(_tiny_decode_args(k_buffer))
    args[6], args[7], args[8] = torch.ones(1, 2), torch.ones(1, 2), torch.tensor([9])
    with pytest.raises(ValueError, match="cache location 9"):
        attention.decode_attention_cpu(*args)
    assert not k_buffer.any()


@needs_native
@pytest.mark.parametrize("lens_dtype", [torch.int64, torch.int32])
def test_decode_metadata_follows_in_place_updates_of_seq_lens(lens_dtype):
    """The per-forward int64 arrays are reused only while the same tensors are unmodified: a
    seq_lens grown in place (the next step of the same batch) is read again (int32 lengths
    are copied to int64, so only the version check sees the change)."""
    gen = torch.Generator().manual_seed(12)
    seq = [4, 6]
    k_buffer, v_buffer, req_to_token, rows = paged_cache(gen, [n + 1 for n in seq], 1, 4, 4,
                                                          torch.float32)
    q = torch.randn(2, 2, 4, generator=gen)
    lens = torch.tensor(seq, dtype=lens_dtype)
    for step in range(2):
        outs = []
        for op in (attention.decode_attention_cpu, decode_attention_ref):
            o = torch.zeros(2, 2, 4)
            op(q, k_buffer, v_buffer, 1.0, 1.0, o, None, None, torch.tensor([0, 0]), None,
               req_to_token, rows, lens, 0.5, 0.0, False, 0, None, None)
            outs.append(o)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        lens += 1  # same tensor object, one more key each
