"""The lean CPU forward's per-step attention plan against the ops it stands in for, and its
switches. (Lean against sglang's whole layer stack, bit for bit, runs in an engine:
``tests/sglang/test_engine_tiny.py::test_lean_forward_is_bit_identical_to_sglangs``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rhyme_sglang.cpu_backend import attention, lean_forward, native_step, step_plan
from tests.cpu_backend.helpers import attention_impl, paged_cache, random_tree

needs_native = pytest.mark.skipif(attention._native is None, reason="native attention not built")
HEADS, KV_HEADS, DIM = 6, 2, 8


class _Mode:
    def __init__(self, name):
        self.name = name

    def is_decode(self):
        return self.name == "decode"

    def is_target_verify(self):
        return self.name == "verify"


def _backend(req_to_token, extend_metadata=None):
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                           extend_metadata=extend_metadata, draft_decode_metadata=None,
                           use_sliding_window_kv_pool=False)


def _fused(gen, tokens):
    """q [T, H D] and row views k, v of one fused projection, as the model's qkv split gives."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q = qkv[:, : HEADS * DIM].contiguous()
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].contiguous()  # rotary returns a copy
    v = qkv[:, (HEADS + KV_HEADS) * DIM :]
    return q, k, v


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_plan_is_bit_identical_to_the_decode_op(dtype):
    """fp32, and a bf16 model's rows and cache (attended in fp32, the output rounded to bf16
    by both)."""
    gen = torch.Generator().manual_seed(3)
    seq = [5, 9, 2]
    kb, vb, r2t, rows = paged_cache(gen, seq, KV_HEADS, DIM, DIM, dtype)
    q, k, v = (t.to(dtype) for t in _fused(gen, len(seq)))
    last = torch.tensor([int(r2t[r, n - 1]) for r, n in zip(rows.tolist(), seq)])
    lens = torch.tensor(seq)
    batch = SimpleNamespace(forward_mode=_Mode("decode"), out_cache_loc=last,
                            req_pool_indices=rows, seq_lens=lens)
    kb2, vb2 = kb.clone(), vb.clone()
    with attention_impl("native"):
        plan = step_plan.plan_step(_backend(r2t), batch, kb, vb, len(seq))
        got = plan.attend(q, k, v, kb, vb, 0.35)
        want = torch.zeros(len(seq), HEADS, DIM, dtype=dtype)
        attention.decode_attention_cpu(q.view(-1, HEADS, DIM), kb2, vb2, 1.0, 1.0, want,
                                       k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM),
                                       last, None, r2t, rows, lens, 0.35, 0.0, False, 0)
    assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
    assert got.dtype == dtype and torch.equal(got, want.view(len(seq), -1))


@needs_native
@pytest.mark.parametrize("ragged", [False, True])
def test_verify_plan_is_bit_identical_to_the_extend_op(ragged):
    """A tree verify, every request running n nodes (sglang's flat mask) or its own number of
    them (RHYME's ragged [bs, n, n] trees)."""
    gen = torch.Generator().manual_seed(4)
    n, prefix = 4, [3, 7, 1]
    ext = [2, 4, 3] if ragged else [n] * 3
    seq = [p + e for p, e in zip(prefix, ext)]
    kb, vb, r2t, rows = paged_cache(gen, seq, KV_HEADS, DIM, DIM, torch.float32)
    tokens = sum(ext)
    q, k, v = _fused(gen, tokens)
    loc = torch.cat([r2t[r, p : p + e].long() for r, p, e in zip(rows.tolist(), prefix, ext)])
    trees = torch.stack([random_tree(gen, n) for _ in seq])
    ext_t = torch.tensor(ext, dtype=torch.int32)
    starts = torch.cumsum(ext_t, 0) - ext_t
    mask = trees if ragged else trees.reshape(-1)
    meta = (torch.tensor(seq), ext_t, starts, mask)
    batch = SimpleNamespace(forward_mode=_Mode("verify"), out_cache_loc=loc,
                            req_pool_indices=rows, seq_lens=torch.tensor(prefix))
    kb2, vb2 = kb.clone(), vb.clone()
    with attention_impl("native"):
        plan = step_plan.plan_step(_backend(r2t, meta), batch, kb, vb, tokens)
        got = plan.attend(q, k, v, kb, vb, 0.35)
        # sglang's verify: the K/V written by the pool first, then the op
        kb2[loc], vb2[loc] = k.view(-1, KV_HEADS, DIM), v.reshape(-1, KV_HEADS, DIM)
        want = torch.zeros(tokens, HEADS, DIM)
        attention.extend_attention_cpu(q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM),
                                       v.reshape(-1, KV_HEADS, DIM), want, kb2, vb2, 1.0, 1.0,
                                       r2t, rows, *meta[:3], n, 0.35, 0.0, False, 0, None, None,
                                       mask, True)
    assert torch.equal(kb, kb2) and torch.equal(vb, vb2)
    assert torch.equal(got, want.view(tokens, -1))


def test_no_plan_where_the_general_path_is_needed():
    gen = torch.Generator().manual_seed(5)
    kb, vb, r2t, rows = paged_cache(gen, [3], KV_HEADS, DIM, DIM, torch.float32)
    batch = SimpleNamespace(forward_mode=_Mode("decode"), out_cache_loc=torch.tensor([0]),
                            req_pool_indices=rows, seq_lens=torch.tensor([3]))
    with attention_impl("torch"):  # native attention off
        assert step_plan.plan_step(_backend(r2t), batch, kb, vb, 1) is None
    if attention._native is None:
        return
    with attention_impl("native"):
        assert step_plan.plan_step(_backend(r2t), batch, kb.half(), vb.half(), 1) is None
        assert step_plan.plan_step(_backend(r2t), batch, kb.bfloat16(), vb, 1) is None
        drafting = _backend(r2t)
        drafting.draft_decode_metadata = (r2t, torch.tensor([3]), rows)
        assert step_plan.plan_step(drafting, batch, kb, vb, 1) is None
        sliding = _backend(r2t)
        sliding.use_sliding_window_kv_pool = True
        assert step_plan.plan_step(sliding, batch, kb, vb, 1) is None
        assert step_plan.plan_step(_backend(r2t), batch, kb, vb, 2) is None  # rows != tokens
        batch.forward_mode = _Mode("extend")  # prefill keeps sglang's path
        assert step_plan.plan_step(_backend(r2t), batch, kb, vb, 1) is None


def test_lean_mode_reads_its_switch(monkeypatch):
    assert lean_forward.mode({}) == "on"
    assert lean_forward.mode({lean_forward.MODE_ENV: "check"}) == "check"
    with pytest.raises(ValueError, match="RHYME_CPU_LEAN.*'fast'"):
        lean_forward.mode({lean_forward.MODE_ENV: "fast"})


def test_native_step_switch_and_where_it_steps_aside(monkeypatch):
    """``RHYME_CPU_STEP`` picks the native decoder step or the Python loop; without an
    attention plan (or with the Python loop chosen) ``run`` returns None and the Python loop
    runs. (The native step against sglang's stack, bit for bit, is the engine check test.)"""
    assert native_step.enabled({native_step.MODE_ENV: "python"}) is False
    assert native_step.enabled({}) is (native_step._native is not None)
    with pytest.raises(ValueError, match="RHYME_CPU_STEP.*'fast'"):
        native_step.enabled({native_step.MODE_ENV: "fast"})
    ids = torch.tensor([1, 2, 3])
    positions = torch.arange(3)
    assert native_step.run(None, ids, positions, None, None) is None  # no plan
    plan = SimpleNamespace()
    monkeypatch.setenv(native_step.MODE_ENV, "python")
    assert native_step.run(None, ids, positions, None, plan) is None
    monkeypatch.setenv(native_step.MODE_ENV, "native")
    assert native_step.run(None, ids, positions.int(), None, plan) is None  # not int64 positions


@pytest.mark.skipif(native_step._native is None, reason="_rhyme_step is not built")
def test_native_step_binds_the_kernel_tables():
    """The step module found all three kernel tables (of the current kernels.h version), and
    a bind with a wrong table keeps the ones it had."""
    from rhyme_sglang.cpu_backend import _rhyme_attention, _rhyme_gemm, _rhyme_ops, _rhyme_step

    assert _rhyme_step.bound()
    with pytest.raises(ValueError, match="rhyme_kernels::Gemm"):
        _rhyme_step.bind(_rhyme_ops._kernels, _rhyme_ops._kernels, _rhyme_attention._kernels)
    with pytest.raises(ValueError, match="rhyme_kernels::Attention"):
        _rhyme_step.bind(_rhyme_gemm._kernels, _rhyme_ops._kernels, _rhyme_gemm._kernels)
    assert _rhyme_step.bound()
