"""Reference attention for sglang's ``intel_amx`` backend, in plain PyTorch.

Implements ``torch.ops.sgl_kernel.extend_attention_cpu`` and ``decode_attention_cpu``
with the argument lists that ``IntelAMXAttnBackend`` passes (sglang 0.5.23): grouped-query
attention over the paged KV cache (``req_to_token`` rows), a causal mask within the
extend part, and the speculative tree mask for TARGET_VERIFY batches. Math is done in
float32 and cast back to the output dtype. Unsupported features (sliding window,
attention sinks, cross attention, logit soft-capping is supported) raise
``NotImplementedError`` naming the op, never return garbage.
"""

from __future__ import annotations

from typing import Optional

import torch

_LIB = None


def _unsupported(op: str, what: str):
    raise NotImplementedError(f"sgl_kernel stand-in op {op!r}: {what} is not implemented on CPU")


def _check_features(op, is_cross, sliding_window, sinks, encoder_lens=None):
    if is_cross:
        _unsupported(op, "cross attention")
    if sliding_window is not None and sliding_window > 0:
        _unsupported(op, "sliding-window attention")
    if sinks is not None:
        _unsupported(op, "attention sinks")


def _attend(q, k, v, sm_scale, logit_cap, mask=None):
    """q [Lq, H, D], k/v [Lk, Hkv, D*], mask [Lq, Lk] bool (True = visible) -> [Lq, H, Dv]."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qf = q.float().transpose(0, 1)  # H, Lq, D
    kf = k.float().transpose(0, 1)  # H, Lk, D
    vf = v.float().transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)  # Lq, H, Dv


def extend_attention_cpu(
    q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
    seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
    is_cross, sliding_window, encoder_lens=None, sinks=None, tree_mask=None, is_causal=True,
):
    """Prefill / extend / verify attention. ``o`` is written in place."""
    op = "extend_attention_cpu"
    _check_features(op, is_cross, sliding_window, sinks)
    if k_buffer.dtype == torch.float8_e4m3fn:
        _unsupported(op, "fp8 KV cache")
    seq_lens_l = seq_lens.tolist()
    ext_lens_l = extend_seq_lens.tolist()
    starts_l = extend_start_loc.tolist()
    pool_l = req_pool_indices.tolist()
    for i, (seq_len, ext_len, start, row) in enumerate(zip(seq_lens_l, ext_lens_l, starts_l, pool_l)):
        if ext_len == 0:
            continue
        prefix_len = seq_len - ext_len
        locs = req_to_token[row, :prefix_len].long()
        k_pre, v_pre = k_buffer[locs], v_buffer[locs]
        if k is not None:
            k_ext, v_ext = k[start : start + ext_len], v[start : start + ext_len]
        else:  # KV-shared layers: the owner layer already wrote the extend K/V
            ext_locs = req_to_token[row, prefix_len:seq_len].long()
            k_ext, v_ext = k_buffer[ext_locs], v_buffer[ext_locs]
        keys = torch.cat([k_pre, k_ext.to(k_pre.dtype)], dim=0)
        values = torch.cat([v_pre, v_ext.to(v_pre.dtype)], dim=0)
        mask = None
        if tree_mask is not None:
            n = ext_len
            tm = tree_mask.view(-1)[i * n * n : (i + 1) * n * n].view(n, n).bool()
            mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tm], dim=1)
        elif is_causal:
            ext_mask = torch.ones(ext_len, ext_len, dtype=torch.bool).tril_()
            mask = torch.cat([torch.ones(ext_len, prefix_len, dtype=torch.bool), ext_mask], dim=1)
        out = _attend(q[start : start + ext_len], keys, values, sm_scale, logit_cap, mask)
        o[start : start + ext_len] = out.to(o.dtype)


def decode_attention_cpu(
    q, k_buffer, v_buffer, k_scale, v_scale, o, k, v, cache_loc, attn_logits, req_to_token,
    req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross, sliding_window,
    encoder_lens=None, sinks=None,
):
    """One-token decode attention; writes the new token's K/V into the cache first."""
    op = "decode_attention_cpu"
    _check_features(op, is_cross, sliding_window, sinks)
    if k is not None and v is not None:
        loc = cache_loc.long()
        k_buffer[loc] = k.view(k.shape[0], k_buffer.shape[1], -1).to(k_buffer.dtype)
        v_buffer[loc] = v.view(v.shape[0], v_buffer.shape[1], -1).to(v_buffer.dtype)
    for i, (seq_len, row) in enumerate(zip(seq_lens.tolist(), req_pool_indices.tolist())):
        locs = req_to_token[row, :seq_len].long()
        out = _attend(q[i : i + 1], k_buffer[locs], v_buffer[locs], sm_scale, logit_cap)
        o[i] = out[0].to(o.dtype)


_EXTEND_SCHEMA = (
    "extend_attention_cpu(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, Tensor(b!) k_buffer, "
    "Tensor(c!) v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)
_DECODE_SCHEMA = (
    "decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, "
    "float v_scale, Tensor(c!) o, Tensor? k, Tensor? v, Tensor cache_loc, Tensor attn_logits, "
    "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, "
    "float logit_cap, bool is_cross, int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()"
)


def register_torch_ops() -> None:
    """Register both ops under ``torch.ops.sgl_kernel`` (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define(_EXTEND_SCHEMA)
    lib.define(_DECODE_SCHEMA)
    lib.impl("extend_attention_cpu", extend_attention_cpu, "CPU")
    lib.impl("decode_attention_cpu", decode_attention_cpu, "CPU")
    _LIB = lib
