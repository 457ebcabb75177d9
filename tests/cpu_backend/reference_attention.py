"""The per-request loop attention that the batched CPU backend replaced, kept as the reference.

Same argument lists as ``rhyme_sglang.cpu_backend.attention``'s ops (sglang 0.5.23's
``extend_attention_cpu`` / ``decode_attention_cpu``). One request at a time: gather its KV
rows, repeat the KV heads for GQA, attend in float32, cast back. Test code only.
"""

from __future__ import annotations

import torch


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


def extend_attention_ref(
    q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
    seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
    is_cross, sliding_window, encoder_lens=None, sinks=None, tree_mask=None, is_causal=True,
):
    """Prefill / extend / verify attention, one request at a time. ``o`` is written in place."""
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
        if tree_mask is not None and tree_mask.dim() == 3:  # ragged verify: [bs, n, n]
            tm = tree_mask[i, :ext_len, :ext_len].bool()
            mask = torch.cat([torch.ones(ext_len, prefix_len, dtype=torch.bool), tm], dim=1)
        elif tree_mask is not None:
            n = ext_len
            tm = tree_mask.view(-1)[i * n * n : (i + 1) * n * n].view(n, n).bool()
            mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), tm], dim=1)
        elif is_causal:
            ext_mask = torch.ones(ext_len, ext_len, dtype=torch.bool).tril_()
            mask = torch.cat([torch.ones(ext_len, prefix_len, dtype=torch.bool), ext_mask], dim=1)
        out = _attend(q[start : start + ext_len], keys, values, sm_scale, logit_cap, mask)
        o[start : start + ext_len] = out.to(o.dtype)


def decode_attention_ref(
    q, k_buffer, v_buffer, k_scale, v_scale, o, k, v, cache_loc, attn_logits, req_to_token,
    req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross, sliding_window,
    encoder_lens=None, sinks=None,
):
    """One-token decode attention, one request at a time; writes the new K/V first."""
    if k is not None and v is not None:
        loc = cache_loc.long()
        k_buffer[loc] = k.view(k.shape[0], k_buffer.shape[1], -1).to(k_buffer.dtype)
        v_buffer[loc] = v.view(v.shape[0], v_buffer.shape[1], -1).to(v_buffer.dtype)
    for i, (seq_len, row) in enumerate(zip(seq_lens.tolist(), req_pool_indices.tolist())):
        locs = req_to_token[row, :seq_len].long()
        out = _attend(q[i : i + 1], k_buffer[locs], v_buffer[locs], sm_scale, logit_cap)
        o[i] = out[0].to(o.dtype)
