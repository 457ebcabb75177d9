"""KV-cache index bookkeeping ops that sglang's CPU path imports from ``sgl_kernel``.

Each function mirrors the Triton kernel of the same name in sglang 0.5.23 (the contract
is the kernel's: which rows of ``req_to_token`` are read or written, in which order).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from rhyme_sglang.cpu_backend.attention import _native  # paged attention module, or None


def _packed_cells(req_pool_indices, start_offset, end_offset):
    """``(rows, columns, packed)`` for every ``req_to_token`` cell the segments cover: cell k
    is ``req_to_token[rows[k], columns[k]]`` and packed slot ``packed[k]``. As in the kernel,
    segment i's packed slots start at the sum of ``end - start`` over the segments before it,
    negative lengths included, and a segment that ends before it starts covers no cell. One
    gather / scatter for the batch instead of a tensor slice per request (0.4-0.6 ms at 32
    requests on a 2-core CPU, on every speculative step)."""
    starts = start_offset.to(torch.int64)
    lens = end_offset.to(torch.int64) - starts
    covered = lens.clamp(min=0)
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), covered)
    # position of each cell inside its own segment
    within = torch.arange(rows.numel(), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(covered, 0) - covered, covered)
    cols = torch.repeat_interleave(starts, covered) + within
    packed = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, covered) + within
    return rows, cols, packed


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """``req_to_token[row_i, start_i:end_i] = out_cache_loc[packed segment i]``."""
    rows, cols, packed = _packed_cells(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[packed].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """``out_cache_loc[packed segment i] = req_to_token[row_i, start_i:end_i]``."""
    rows, cols, packed = _packed_cells(req_pool_indices, start_offset, end_offset)
    out_cache_loc[packed] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens,
                                           out_cache_loc, pool_len, topk, num_cols):
    """Copy each request's ``topk * num_cols`` slots from ``seq_lens`` on, packed."""
    width = topk * num_cols
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[row, s : s + width].to(
            out_cache_loc.dtype
        )


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``bonus[i] = accept_tokens[i * stride + accept_lens[i] - 1]``."""
    lens = accept_lens.long()
    idx = torch.arange(lens.numel(), dtype=torch.long) * accept_stride + lens - 1
    bonus_tokens.copy_(accept_tokens.view(-1)[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Pack ``out_cache_loc[accept_index]`` over the entries that are not -1."""
    flat = accept_index.view(-1).long()
    valid = flat[flat != -1]
    accept_out_cache_loc[: valid.numel()] = out_cache_loc[valid].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer (raw pointer + row stride in bytes): ``row[tgt] = row[src]``. One
    native call for all buffers where the attention module is built (a verify step moves its
    accepted tokens' K/V in every layer: 60 buffers for a 30-layer model)."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.long().contiguous()
    src = src_loc.long().contiguous()
    if tgt.numel() != src.numel():
        raise ValueError(f"copy_all_layer_kv_cache: {tgt.numel()} targets for {src.numel()} sources")
    if _native is not None and hasattr(_native, "copy_rows"):
        ptrs = data_ptrs.to(torch.int64).contiguous()
        row_bytes = strides.to(torch.int64).contiguous()
        _native.copy_rows(ptrs.data_ptr(), row_bytes.data_ptr(), ptrs.numel(), tgt.data_ptr(),
                          src.data_ptr(), tgt.numel())
        return
    num_rows = int(max(tgt.max().item(), src.max().item())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * stride)).from_address(int(ptr))
        rows = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(num_rows, stride)
        rows[tgt] = rows[src].clone()
