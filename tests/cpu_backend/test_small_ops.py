"""The native RMSNorm and rotary embedding equal sglang's PyTorch ops, keep each row's bits
independent of the other rows, and refuse bad positions; the patched sglang layers use them
only for the variants they implement."""

from __future__ import annotations

import pytest
import torch

from rhyme_sglang.cpu_backend import small_ops
from tests.cpu_backend.helpers import run_python

pytestmark = pytest.mark.skipif(small_ops._native is None, reason="_rhyme_ops is not built")


def _reference_rmsnorm(x, weight, eps, residual=None):
    """sglang's ``RMSNorm.forward_native`` for fp32."""
    if residual is not None:
        x = x + residual
        residual = x
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    out = (x * torch.rsqrt(variance + eps)) * weight
    return out if residual is None else (out, residual)


def _reference_rotary(positions, query, key, cache, head_size, rot, neox):
    """sglang's ``RotaryEmbedding.forward_native`` (via its ``apply_rotary_emb``)."""
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

    def apply(x):
        shape = x.shape
        x = x.view(positions.numel(), -1, head_size)
        part, rest = x[..., :rot], x[..., rot:]
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if neox:
            x1, x2 = part.chunk(2, dim=-1)
        else:
            x1, x2 = part[..., ::2], part[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        part = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((part, rest), -1).reshape(shape)

    return apply(query), apply(key)


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("hidden", [576, 37])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_sglang(rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    got = small_ops.rmsnorm(x, weight, 1e-5, residual)
    want = _reference_rmsnorm(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1])  # the sum is one rounding either way
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out = got[0] if with_residual else got
    one = small_ops.rmsnorm(x[-1:], weight, 1e-5, None if residual is None else residual[-1:])
    assert torch.equal((one[0] if with_residual else one)[0], out[-1])  # row-invariant


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("fused", [False, True])
def test_rotary_matches_sglang(neox, rot, fused):
    gen = torch.Generator().manual_seed(rot + neox)
    head_size, tokens = 64, 11
    cache = torch.randn(300, rot, generator=gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    if fused:  # q and k as sglang's models pass them: row views of one qkv tensor
        qkv = torch.randn(tokens, 15 * head_size, generator=gen)
        query, key, _ = qkv.split([9 * head_size, 3 * head_size, 3 * head_size], dim=-1)
        assert not query.is_contiguous()
    else:
        query = torch.randn(tokens, 9 * head_size, generator=gen)
        key = torch.randn(tokens, 3 * head_size, generator=gen)
    assert small_ops.rotary_fits(positions, query, key, cache, head_size, rot)
    q, k = small_ops.rotary(positions, query, key, cache, head_size, rot, neox)
    q_ref, k_ref = _reference_rotary(positions, query, key, cache, head_size, rot, neox)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)  # same products, same roundings
    assert q.shape == query.shape and k.shape == key.shape


def test_rotary_refuses_a_position_outside_its_table():
    cache = torch.randn(16, 64)
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(IndexError, match="position 16 is outside the rotary table of 16"):
        small_ops.rotary(torch.tensor([3, 16]), q, k, cache, 64, 64, True)


def test_bad_mode_names_the_value():
    with pytest.raises(ValueError, match="'fastest'"):
        small_ops.enabled({small_ops.MODE_ENV: "fastest"})
    assert not small_ops.enabled({small_ops.MODE_ENV: "torch"})


@pytest.mark.sglang
def test_patched_sglang_layers_equal_their_own_ops():
    """sglang's RMSNorm and RotaryEmbedding, patched by the CPU backend in a fresh process, give
    what their own PyTorch path gives (``RHYME_CPU_SMALL_OPS=torch``), and leave a variant
    they do not implement to sglang."""

    r = run_python("""
        import os
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        from rhyme_sglang import cpu_backend
        cpu_backend.activate()
        import torch
        from sglang.srt.layers import layernorm
        from sglang.srt.layers.rotary_embedding import base
        from rhyme_sglang import settings
        from rhyme_sglang.cpu_backend import patches, small_ops
        assert {"native_cpu_rmsnorm", "native_cpu_rotary"} <= patches.APPLIED
        gen = torch.Generator().manual_seed(0)
        norm = layernorm.RMSNorm(96, eps=1e-6)
        norm.weight.data.copy_(torch.randn(96, generator=gen))
        rope = base.RotaryEmbedding(64, 64, 512, 10000, True, torch.float32)
        x, residual = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
        positions = torch.arange(7, 12)
        # q and k as the model passes them: row views of its fused qkv projection
        q, k, _ = torch.randn(5, 4 * 64, generator=gen).split([2 * 64, 64, 64], dim=-1)
        calls = []
        for name in ("rmsnorm", "rotary"):
            fn = getattr(small_ops, name)
            setattr(small_ops, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
        native = (*norm.forward_native(x, residual), *rope.forward_native(positions, q, k))
        assert calls == ["rmsnorm", "rotary"], calls
        os.environ[small_ops.MODE_ENV] = "torch"
        settings.reload()
        own = (*norm.forward_native(x, residual), *rope.forward_native(positions, q, k))
        assert calls == ["rmsnorm", "rotary"], calls
        for got, want in zip(native, own):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        os.environ[small_ops.MODE_ENV] = "native"
        settings.reload()
        extra = torch.randn(5, 96, generator=gen)
        out, summed = norm.forward_native(x, residual, post_residual_addition=extra)
        assert calls == ["rmsnorm", "rotary"], calls
        torch.testing.assert_close(summed, x + residual + extra)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("d", [1, 7, 8, 13, 64])
def test_silu_mul_matches_torch_and_keeps_rows_apart(d):
    """``silu(gate) * up`` within float rounding of PyTorch's (its exp is a ~1e-7 polynomial),
    finite for large |gate| (no overflow of exp), and each row's bits independent of the others
    (the verify rows of a step equal the decode rows)."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(5, 2 * d, generator=gen) * 4
    x[0, 0] = 100.0  # exp(-100) underflows to 0: silu = gate
    x[1, 0] = -100.0  # silu -> -0
    if d > 1:
        x[2, 1] = -90.0
    assert small_ops.silu_mul_fits(x)
    got = small_ops.silu_mul(x)
    expected = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    assert got.shape == (5, d) and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    for r in range(5):
        assert torch.equal(small_ops.silu_mul(x[r:r + 1].clone())[0], got[r])
    assert small_ops.silu_mul(torch.empty(0, 2 * d)).shape == (0, d)


def test_silu_mul_fits_only_fp32_or_bf16_cpu_even_rows():
    assert not small_ops.silu_mul_fits(torch.randn(2, 7))
    assert small_ops.silu_mul_fits(torch.randn(2, 8, dtype=torch.bfloat16))
    assert not small_ops.silu_mul_fits(torch.randn(2, 8, dtype=torch.float16))
    assert not small_ops.silu_mul_fits(torch.randn(8, 2).t())  # not contiguous


# ---- bf16 rows: computed in fp32, rounded where PyTorch's bf16 ops round ---------------------
def _bf16_reference_rmsnorm(x, weight, eps, residual=None):
    """sglang's ``RMSNorm.forward_native`` on bf16 tensors."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
        residual = xf.to(torch.bfloat16)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * weight).to(torch.bfloat16)
    return out if residual is None else (out, residual)


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rmsnorm_matches_sglang(rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    residual = torch.randn(rows, 576, generator=gen).bfloat16() if with_residual else None
    assert small_ops.rmsnorm_fits(x, weight, residual)
    assert not small_ops.rmsnorm_fits(x, weight.float(), residual)  # one dtype throughout
    got = small_ops.rmsnorm(x, weight, 1e-5, residual)
    want = _bf16_reference_rmsnorm(x, weight, 1e-5, residual)
    if with_residual:
        assert got[0].dtype == got[1].dtype == torch.bfloat16
        assert torch.equal(got[1], want[1])  # one fp32 add, one rounding either way
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want)  # bf16 tolerance: the sum of squares' order differs
    assert (got != want).float().mean() < 0.01
    one = small_ops.rmsnorm(x[-1:], weight, 1e-5, None if residual is None else residual[-1:])
    assert torch.equal((one[0] if with_residual else one)[0], got[-1])


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_bf16_rotary_is_pytorchs_bf16_ops_bit_for_bit(neox, fused):
    """With a bf16 table (sglang casts it to the model's dtype on CPU): every product and sum
    rounded to bf16, as PyTorch's separate ops on bf16 tensors round them."""
    gen = torch.Generator().manual_seed(5 + neox)
    head_size, tokens, rot = 64, 11, 32
    cache = torch.randn(300, rot, generator=gen).bfloat16()
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    qkv = torch.randn(tokens, 15 * head_size, generator=gen).bfloat16()
    query, key, _ = qkv.split([9 * head_size, 3 * head_size, 3 * head_size], dim=-1)
    if not fused:
        query, key = query.contiguous(), key.contiguous()
    assert small_ops.rotary_fits(positions, query, key, cache, head_size, rot)
    assert not small_ops.rotary_fits(positions, query, key, cache.float(), head_size, rot)
    q, k = small_ops.rotary(positions, query, key, cache, head_size, rot, neox)
    q_ref, k_ref = _reference_rotary(positions, query, key, cache, head_size, rot, neox)
    assert q.dtype == torch.bfloat16 and torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_bf16_silu_mul_matches_torch_and_keeps_rows_apart():
    gen = torch.Generator().manual_seed(2)
    d = 13
    x = (torch.randn(5, 2 * d, generator=gen) * 4).bfloat16()
    got = small_ops.silu_mul(x)
    expected = torch.nn.functional.silu(x[:, :d]) * x[:, d:]  # two bf16 roundings
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
    assert (got != expected).float().mean() < 0.05  # silu's exp is ~1e-7 off torch's
    for r in range(5):
        assert torch.equal(small_ops.silu_mul(x[r:r + 1].clone())[0], got[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", [(9, 1536), (72, 1536), (5, 2000), (40, 300)])
def test_silu_mul_split_over_threads_changes_no_bit(monkeypatch, dtype, rows, d):
    """From 8k elements the rows and 256-column chunks are parts on the kernel threads; each
    element depends only on its own inputs, so the result is the one-thread result."""
    from rhyme_sglang import machine

    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(rows + d)).to(dtype)
    monkeypatch.setattr(machine, "_kernel_threads", 1)
    alone = small_ops.silu_mul(x)
    monkeypatch.setattr(machine, "_kernel_threads", 2)
    assert torch.equal(small_ops.silu_mul(x), alone)
    ref = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(alone.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_whole_groups_and_tail_agree(dtype):
    """Whole groups of eight run in vector registers, a row's tail element by element: an
    element gets the same bits in either (a row of 13 has both; a NaN stays NaN)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 26, generator=gen) * 4).to(dtype)
    x[1, 2] = float("nan")
    x[2, 3] = float("inf")
    got = small_ops.silu_mul(x)
    assert torch.isnan(got[1, 2])
    for c in range(13):  # column c alone is a tail of one element
        alone = small_ops.silu_mul(torch.stack([x[:, c], x[:, 13 + c]], dim=1).contiguous())
        assert torch.equal(torch.isnan(alone[:, 0]), torch.isnan(got[:, c]))
        assert torch.equal(alone[:, 0].nan_to_num(0.0), got[:, c].nan_to_num(0.0)), c
