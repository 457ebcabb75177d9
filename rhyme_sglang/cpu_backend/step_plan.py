"""One decode or verify forward's attention arguments, converted once for all layers.

The lean forward (:mod:`.lean_forward`) asks :func:`plan_step` for a :class:`StepPlan` before
its layers run; each layer's :meth:`StepPlan.attend` then stores its K/V rows and calls the
native paged attention (:mod:`.attention`'s native path) without the per-layer checks and
conversions of the ``torch.ops`` entry points. None where the general path is needed.
"""

from __future__ import annotations

import torch

from rhyme_sglang.cpu_backend.attention import _decode_meta, _native_call, _store_kv, native_enabled


class StepPlan:
    """What every layer of one DECODE or TARGET_VERIFY forward passes to the native kernels,
    converted once for all layers: the cache rows to write, the per-request int64 arrays and
    the tree. :meth:`attend` then does what ``decode_attention_cpu`` / ``extend_attention_cpu``
    do on their native path (the same ``_store_kv`` and ``_native_call``), minus their
    per-layer checks and conversions. Built by :func:`plan_step`, for an fp32 or bf16 K/V cache."""

    __slots__ = ("req_to_token", "longs", "cache_loc", "tree", "verify")

    def __init__(self, req_to_token, longs, cache_loc, tree, verify: bool):
        self.req_to_token = req_to_token  # [pool rows, max len] int32
        self.longs = longs  # pool rows, seq lens, extend lens, starts: [B] int64 each
        self.cache_loc = cache_loc  # [T] int64: where this step's K/V rows go
        self.tree = tree  # [B, n, n] uint8 or None
        self.verify = verify

    def attend(self, q, k, v, k_buffer, v_buffer, sm_scale: float) -> torch.Tensor:
        """Store this step's K/V rows, attend; q [T, H * D] contiguous, k/v [T, Hkv * D*] rows
        with unit inner stride, all in the cache's dtype. Returns o [T, H * Dv] in q's dtype
        (attended in fp32; bf16 rounded from it, as the ops' copy into a bf16 output rounds)."""
        _store_kv(k_buffer, v_buffer, k, v, self.cache_loc, native=True)
        rows, d, dv = q.shape[0], k_buffer.shape[2], v_buffer.shape[2]
        heads = q.shape[1] // d
        o = torch.empty(rows, heads, dv)
        fresh = (k, v) if self.verify else (None, None)  # as extend_attention_cpu: the op's own
        _native_call(q.view(rows, heads, d), o, k_buffer, v_buffer, self.req_to_token,
                     self.longs, sm_scale, 0.0, True, *fresh, tree=self.tree)
        return o.view(rows, heads * dv).to(q.dtype)


def plan_step(backend, forward_batch, k_buffer, v_buffer, tokens: int):
    """A :class:`StepPlan` for this forward of sglang's ``intel_amx`` backend, or None where
    its layers need the general path (native attention off, a K/V dtype or pool it cannot
    read, draft-model or sliding-window metadata, an uneven verify layout)."""
    req_to_token = backend.req_to_token_pool.req_to_token
    if (not native_enabled() or getattr(backend, "draft_decode_metadata", None) is not None
            or getattr(backend, "use_sliding_window_kv_pool", False)
            or k_buffer.dtype not in (torch.float32, torch.bfloat16) or v_buffer.dtype != k_buffer.dtype
            or not k_buffer.is_contiguous() or not v_buffer.is_contiguous()
            or req_to_token.dtype != torch.int32 or req_to_token.dim() != 2
            or req_to_token.stride(1) != 1):
        return None
    cache_loc = forward_batch.out_cache_loc.to(torch.int64).contiguous()
    if cache_loc.shape[0] != tokens:
        return None
    mode = forward_batch.forward_mode
    if mode.is_decode():
        longs = _decode_meta(forward_batch.req_pool_indices, forward_batch.seq_lens)
        if longs[0].shape[0] != tokens:
            return None
        return StepPlan(req_to_token, longs, cache_loc, None, verify=False)
    if not mode.is_target_verify() or backend.extend_metadata is None:
        return None
    seq_lens, ext_lens, starts, tree_mask = backend.extend_metadata
    bsz = seq_lens.shape[0]
    longs = [x.to(torch.int64).contiguous()
             for x in (forward_batch.req_pool_indices, seq_lens, ext_lens, starts)]
    if bsz == 0 or int((longs[3] + longs[2].clamp(min=0)).max()) > tokens:
        return None
    tree = None
    if tree_mask is not None and tree_mask.dim() == 3:  # ragged: [bs, n, n]
        tree = tree_mask.to(torch.uint8).contiguous()
    elif tree_mask is not None:
        lq = int(longs[2].max())
        tree = tree_mask.reshape(-1)[: bsz * lq * lq].view(bsz, lq, lq).to(torch.uint8).contiguous()
    return StepPlan(req_to_token, longs, cache_loc, tree, verify=True)
