"""RMSNorm, rotary embedding and SiLU-and-mul for CPU steps, one native call each
(``_native/small_ops.cpp``).

sglang's CPU path without its AMX kernels runs ``RMSNorm.forward_native`` (7-9 PyTorch ops) and
``RotaryEmbedding.forward_native`` (~25 ops) twice and once a layer, and ``SiluAndMul`` (3 ops
and a copy). At decode's few rows every op is dispatch overhead. The patches in :mod:`.patches`
send the calls these functions can take (fp32 or bf16 CPU tensors, the plain variants) here and
leave the rest to sglang.

Each row is computed on its own, so the ops keep the row invariance of the native GEMM and
attention. Results equal sglang's within float rounding (the norm sums its squares in another
order; the rotary rounds exactly as PyTorch's separate products and sums do; SiLU's exp is a
polynomial good to ~1e-7 relative). bf16 rows are computed in fp32 and rounded to bf16 where
sglang's ops on bf16 tensors round (the rotary: every product and sum, the same bits).
``RHYME_CPU_SMALL_OPS=torch`` keeps sglang's ops everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from rhyme_sglang import settings as _settings
from rhyme_sglang.machine import kernel_threads

try:
    from . import _rhyme_ops as _native
except ImportError:  # not built: sglang's own ops
    _native = None


MODE_ENV = _settings.ENV_NAMES["cpu_small_ops"]


def enabled(env: Optional[dict] = None) -> bool:
    return _settings.of(env).cpu_small_ops == "native" and _native is not None


_DTYPES = (torch.float32, torch.bfloat16)


def _cpu(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Contiguous CPU tensors, all of ``dtype``, one the kernels take (fp32 or bf16)."""
    return dtype in _DTYPES and all(t.dtype == dtype and t.device.type == "cpu"
                                    and t.is_contiguous() for t in tensors)


def _op(name: str, dtype: torch.dtype):
    """The native op ``name`` for rows of ``dtype`` (bf16 ones round as PyTorch's bf16 ops)."""
    return getattr(_native, name + "_bf16" if dtype == torch.bfloat16 else name)


def rmsnorm_fits(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> bool:
    n = weight.numel()
    return (x.dim() >= 1 and x.shape[-1] == n and weight.dim() == 1 and _cpu(x.dtype, x, weight)
            and (residual is None or (residual.shape == x.shape and _cpu(x.dtype, residual))))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: Optional[torch.Tensor] = None):
    """``x / rms(x) * weight``; with ``residual``, ``(norm(x + residual), x + residual)``. In
    bf16 as sglang's ``forward_native``: the sum rounded to bf16, the norm from its fp32 value."""
    n = weight.numel()
    rows = x.numel() // n
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    _op("rmsnorm", x.dtype)(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                            weight.data_ptr(), out.data_ptr(),
                            0 if summed is None else summed.data_ptr(), rows, n, float(eps))
    return out if residual is None else (out, summed)


def _rows(x: torch.Tensor, tokens: int, head_size: int) -> Optional[int]:
    """The row stride (elements) of ``x`` read as ``tokens`` rows of whole heads, or None where
    it is not such a layout: contiguous, or 2-D with contiguous rows (q or k split out of a
    fused qkv row, as sglang's models do)."""
    if x.dtype not in _DTYPES or x.device.type != "cpu" or tokens == 0:
        return None
    if x.is_contiguous():
        width = x.numel() // tokens
    elif x.dim() == 2 and x.shape[0] == tokens and x.stride(1) == 1 and x.stride(0) >= x.shape[1]:
        width = x.shape[1]
    else:
        return None
    if width * tokens != x.numel() or width % head_size:
        return None
    return width if x.is_contiguous() else x.stride(0)


def rotary_fits(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int) -> bool:
    tokens = positions.numel()
    return (positions.dtype == torch.int64 and positions.is_contiguous()
            and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim
            and 0 < rotary_dim <= head_size and rotary_dim % 2 == 0
            and _cpu(query.dtype, cos_sin_cache) and key.dtype == query.dtype
            and _rows(query, tokens, head_size) is not None
            and _rows(key, tokens, head_size) is not None)


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int, neox: bool):
    """Rotated contiguous copies of ``query`` and ``key`` (shapes kept), as sglang's
    ``forward_native`` returns them; the inputs may be row views of a fused qkv tensor."""
    tokens = positions.numel()
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    if tokens:
        q_stride, k_stride = _rows(query, tokens, head_size), _rows(key, tokens, head_size)
        _op("rotary", query.dtype)(
            positions.data_ptr(), query.data_ptr(), q_stride, key.data_ptr(), k_stride,
            q_out.data_ptr(), k_out.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0],
            tokens, query.numel() // (tokens * head_size), key.numel() // (tokens * head_size),
            head_size, rotary_dim, bool(neox), kernel_threads())
    return q_out, k_out


def silu_mul_fits(x: torch.Tensor) -> bool:
    return x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0 and _cpu(x.dtype, x)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x[..., :d]) * x[..., d:]`` for a fused gate/up ``x`` of last dim 2d."""
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    rows = x.numel() // (2 * d)
    if rows:
        _op("silu_mul", x.dtype)(x.data_ptr(), out.data_ptr(), rows, d, kernel_threads())
    return out
