"""Batched attention for sglang's ``intel_amx`` backend, in plain PyTorch.

Implements ``torch.ops.sgl_kernel.extend_attention_cpu`` and ``decode_attention_cpu`` with
the argument lists that ``IntelAMXAttnBackend`` passes (sglang 0.5.23). All requests of a
batch are attended together, with no per-request Python loop:

1. one index tensor ``[B, Lk]`` built from the ``req_to_token`` rows (padded to the longest
   sequence) gathers every request's K/V from the paged cache;
2. in extend / verify the extend tokens' own K/V (the op's ``k``/``v``) are written over their
   positions, and the queries are gathered into ``[B, Lq, H, D]``;
3. one boolean mask ``[B, Lq, Lk]`` says what each query sees: its whole prefix, then the
   causal or speculative-tree mask over the extend part, nothing past ``seq_len``;
4. grouped-query attention folds the group into the query axis
   (``q [B, Hkv, g * Lq, D]`` against ``k [B, Hkv, Lk, D]``): K/V heads are never repeated;
5. ``scaled_dot_product_attention`` with the boolean mask does the math (on CPU it was
   measured faster than matmul + softmax and a per-KV-head loop, and equal to 3e-7 in fp32);
   half-precision inputs are attended in float32, as the per-request reference did; a logit
   soft-cap, which SDPA lacks, goes through matmul + tanh + softmax. Outputs are written in place.
   Attending bf16 in bf16 was measured and rejected (AMX Xeon, one thread): SmolLM2
   decode at batch 32 went from ~275 to ~200 ms a step, but SDPA's bf16 kernels round
   differently at one query row (decode) and at several (verify), and the tiny model's bf16
   NGRAM greedy output then left plain decoding's at token 38: not lossless.

A batch whose padded working set would pass ``CHUNK_BYTES`` is attended in chunks of requests
of similar length, each chunk still batched. Unsupported features (sliding window, attention
sinks, cross attention, fp8 KV cache) raise ``NotImplementedError`` naming the op.

**Native paged path.** When the C++ module ``_rhyme_attention`` is built (``pip install -e .``,
done by ``make setup``), decode, every verify tree and every extend of at most
``NATIVE_MAX_EXTEND`` tokens are attended by it instead: it reads each request's keys and
values straight from the paged cache, in the cache's dtype, once for all of its query rows,
with no padded gather, no conversion pass and no mask tensor. Every query row is computed on
its own with a fixed arithmetic order (fp32 math), so a token's output is bit-identical whether
it is one decode row or a node of a verify tree (which is why trees of any width stay on it):
speculation stays lossless in bf16 as in fp32. Longer extends (prefill) keep the SDPA path,
whose GEMMs are faster there (measured: from ~16 query rows at a 256-token prefix).
``RHYME_CPU_ATTENTION=torch`` turns the native path off, ``native`` requires it.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rhyme_sglang.machine import kernel_threads
from rhyme_sglang.settings import settings

try:
    from . import _rhyme_attention as _native
except ImportError:  # not built: every request takes the batched PyTorch path
    _native = None

CHUNK_BYTES = 256 << 20  # padded K/V + scores of one batched call, before splitting requests
NATIVE_MAX_EXTEND = 16  # longer extends without a tree (prefill) take the SDPA path
_LIB = None


def native_enabled() -> bool:
    """Whether the native paged path is used (``RHYME_CPU_ATTENTION``: auto, native, torch)."""
    choice = settings().cpu_attention
    if choice == "native" and _native is None:
        raise ValueError("RHYME_CPU_ATTENTION=native but rhyme_sglang.cpu_backend._rhyme_attention "
                         "is not built (run `pip install -e .` or `make setup`)")
    return choice != "torch" and _native is not None


def _unsupported(op: str, what: str):
    raise NotImplementedError(f"sgl_kernel stand-in op {op!r}: {what} is not implemented on CPU")


def _check_features(op, is_cross, sliding_window, sinks, k_buffer):
    if is_cross:
        _unsupported(op, "cross attention")
    if sliding_window is not None and sliding_window > 0:
        _unsupported(op, "sliding-window attention")
    if sinks is not None:
        _unsupported(op, "attention sinks")
    if k_buffer.dtype == torch.float8_e4m3fn:
        _unsupported(op, "fp8 KV cache")


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _attend(q, k, v, mask, sm_scale: float, logit_cap: float):
    """Softmax attention of every request at once.

    q [B, Lq, H, D], k [B, Lk, Hkv, D], v [B, Lk, Hkv, Dv], mask [B, Lq, Lk] bool
    (True = visible) or None -> [B, Lq, H, Dv]. Query head ``h`` reads KV head ``h // g``,
    so each KV head's group joins the query axis: q becomes [B, Hkv, g * Lq, D] and meets
    k as the strided view [B, Hkv, Lk, D].
    """
    b, lq, h, d = q.shape
    lk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hkv
    q = q.view(b, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if mask is not None:
        mask = mask.view(b, 1, lq, lk).expand(b, g, lq, lk).reshape(b, 1, g * lq, lk)
    if logit_cap > 0:
        out = _capped_attention(q, k, v, mask, sm_scale, logit_cap)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)
    return out.view(b, hkv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(b, lq, h, dv)


def _capped_attention(q, k, v, mask, sm_scale: float, logit_cap: float):
    """softmax(cap * tanh(q k^T * scale / cap)) v: q [B, Hkv, M, D], k/v [B, Hkv, Lk, D*]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * sm_scale
    scores = logit_cap * torch.tanh(scores / logit_cap)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _gather_rows(buffer, index, dtype):
    """buffer [P, Hkv, D], index [B, L] -> [B, L, Hkv, D] in ``dtype``."""
    rows = torch.index_select(buffer, 0, index.view(-1)).to(dtype)
    return rows.view(*index.shape, *buffer.shape[1:])


def _kv_index(req_to_token, req_pool_indices, seq_lens, max_len: int):
    """Cache locations [B, Lk] of each request's first ``seq_len`` tokens, and which are real.

    Padding positions read location 0 (any valid row) and are masked out by the caller.
    """
    pos = torch.arange(max_len)
    visible = pos.view(1, -1) < seq_lens.view(-1, 1)  # [B, Lk]
    locs = req_to_token[req_pool_indices.long(), :max_len].long()
    return locs.masked_fill_(~visible, 0), visible


class _Requests(NamedTuple):
    """A batch (or one chunk of it): row-aligned per-request tensors plus their maxima."""

    pool_rows: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] tokens in the cache after this step, extend part included
    ext_lens: torch.Tensor  # [B] query tokens (1 for decode)
    starts: torch.Tensor  # [B] first query row of each request in q / o
    tree: torch.Tensor | None  # [B, n, n] ancestor-or-self mask of the draft tree
    max_seq: int
    max_ext: int
    packed: bool  # request b's queries are rows [b * max_ext, (b + 1) * max_ext) of q / o

    def select(self, sel: torch.Tensor, max_seq: int, max_ext: int) -> "_Requests":
        tree = None if self.tree is None else self.tree[sel]
        return _Requests(self.pool_rows[sel], self.seq_lens[sel], self.ext_lens[sel],
                         self.starts[sel], tree, max_seq, max_ext, packed=False)


def _chunks(reqs: _Requests, seq_l: list, ext_l: list, bytes_per_key: int, bytes_per_score: int):
    """``reqs`` whole when its padded working set fits ``CHUNK_BYTES``, else chunks of it.

    Working set of B requests padded to (Lq, Lk): ``B * Lk * (bytes_per_key + Lq * bytes_per_score)``.
    Chunks take requests in order of length, so one long request does not pad the short ones.
    """
    def cost(n, lk, lq):
        return n * lk * (bytes_per_key + lq * bytes_per_score)

    if cost(len(seq_l), reqs.max_seq, reqs.max_ext) <= CHUNK_BYTES:
        return [reqs]
    order = sorted(range(len(seq_l)), key=lambda i: (seq_l[i], ext_l[i]))
    chunks, members, max_ext = [], [], 0
    for i in order:
        lq = max(max_ext, ext_l[i])
        if members and cost(len(members) + 1, seq_l[i], lq) > CHUNK_BYTES:
            chunks.append((members, seq_l[members[-1]], max_ext))
            members, lq = [], ext_l[i]
        members.append(i)
        max_ext = lq
    chunks.append((members, seq_l[members[-1]], max_ext))
    return [reqs.select(torch.tensor(m), s, e) for m, s, e in chunks]


def _visible(reqs: _Requests, kv_real, is_causal: bool):
    """Mask [B, Lq, Lk]: query ``t`` of request ``b`` sees key ``j`` (True = visible).

    With ``prefix = seq_len - ext_len`` and ``r = j - prefix`` (the key's extend offset):
    visible = j < seq_len and (j < prefix or extend rule), where the extend rule is
    ``tree[b, t, r]`` for a draft tree, ``r <= t`` for causal attention, else True.
    """
    lq, lk = reqs.max_ext, reqs.max_seq
    if reqs.tree is None and not is_causal:
        return kv_real.unsqueeze(1).expand(-1, lq, -1)
    prefix = (reqs.seq_lens - reqs.ext_lens).view(-1, 1, 1)
    rel = torch.arange(lk).view(1, 1, lk) - prefix  # [B, 1, Lk]
    if reqs.tree is None:  # causal; r <= t also holds for every prefix key (r < 0)
        return kv_real.unsqueeze(1) & (rel <= torch.arange(lq).view(1, lq, 1))
    # draft tree: every request extends by n = Lq, so a real key has r < n
    in_tree = torch.gather(reqs.tree, 2, rel.clamp(0, lq - 1).expand(-1, lq, -1))
    return kv_real.unsqueeze(1) & ((rel < 0) | in_tree)


def _query_slots(reqs: _Requests):
    """Rows of q / o [B * Lq] for each (request, query offset), and the real slots among them.

    The real slots come as flat positions into ``B * Lq``; None when every slot is real and
    the rows are simply ``0 .. B * Lq - 1`` (a packed batch: decode, uniform verify).
    """
    bsz, lq = reqs.pool_rows.shape[0], reqs.max_ext
    if reqs.packed:
        return torch.arange(bsz * lq), None
    t = torch.arange(lq).view(1, -1)
    q_real = (t < reqs.ext_lens.view(-1, 1)).view(-1)  # [B * Lq]
    rows = (reqs.starts.view(-1, 1).long() + t).view(-1).masked_fill_(~q_real, 0)
    return rows, q_real.nonzero().view(-1)


def _pick(x, real):
    """The real slots of ``x`` (flat positions ``real``; None = all)."""
    return x if real is None else torch.index_select(x, 0, real)


def _write_new_kv(keys, values, k, v, reqs: _Requests, q_rows, real):
    """Put this step's K/V (the op's ``k``/``v`` [T, Hkv, D*]) at key offsets ``prefix + t``.

    keys/values [B, Lk, Hkv, D*], gathered from the cache.
    """
    bsz, lk, hkv = keys.shape[0], keys.shape[1], keys.shape[2]
    prefix = (reqs.seq_lens - reqs.ext_lens).view(-1, 1)
    slot = (torch.arange(bsz).view(-1, 1) * lk + prefix + torch.arange(reqs.max_ext)).view(-1)
    slot, src = _pick(slot, real), _pick(q_rows, real)
    for cache, new in ((keys, k), (values, v)):
        rows = torch.index_select(new.reshape(new.shape[0], hkv, -1), 0, src).to(cache.dtype)
        cache.view(bsz * lk, hkv, -1).index_copy_(0, slot, rows)


def _attend_requests(q, o, k_buffer, v_buffer, req_to_token, reqs: _Requests, mask_of,
                     sm_scale, logit_cap, k=None, v=None):
    """Gather the batch's K/V and queries, attend, and write the real rows of ``o``.

    q [T, H, D], o [T, H, Dv], k_buffer/v_buffer [P, Hkv, D*]; ``mask_of(kv_real)`` gives the
    [B, Lq, Lk] mask (or None: all visible) from the [B, Lk] real-key mask.
    """
    dtype = _math_dtype(q.dtype)
    bsz, lq = reqs.pool_rows.shape[0], reqs.max_ext
    q_rows, real = _query_slots(reqs)
    locs, kv_real = _kv_index(req_to_token, reqs.pool_rows, reqs.seq_lens, reqs.max_seq)
    keys = _gather_rows(k_buffer, locs, dtype)  # [B, Lk, Hkv, D]
    values = _gather_rows(v_buffer, locs, dtype)
    if k is not None:
        _write_new_kv(keys, values, k, v, reqs, q_rows, real)
    queries = torch.index_select(q, 0, q_rows).to(dtype).view(bsz, lq, *q.shape[1:])
    out = _attend(queries, keys, values, mask_of(kv_real), sm_scale, logit_cap)
    out = _pick(out.reshape(bsz * lq, *out.shape[2:]), real).to(o.dtype)  # [T', H, Dv]
    if real is None:
        o[: bsz * lq].copy_(out)
    else:
        o.index_copy_(0, _pick(q_rows, real), out)


def _native_fits(q, k_buffer, v_buffer, req_to_token) -> bool:
    """Whether the native path can read these tensors as they are (else the PyTorch path)."""
    return (native_enabled() and k_buffer.dtype in (torch.float32, torch.bfloat16)
            and v_buffer.dtype == k_buffer.dtype and k_buffer.is_contiguous()
            and v_buffer.is_contiguous() and req_to_token.dtype == torch.int32
            and req_to_token.dim() == 2 and req_to_token.stride(1) == 1
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _native_attend(q, o, k_buffer, v_buffer, req_to_token, pool_rows, seq_lens, ext_lens,
                   starts, sm_scale, logit_cap, is_causal, k=None, v=None, tree=None):
    """Attend the given requests with the native module; writes their rows of ``o``.

    q [T, H, D], o [T, H, Dv]; per-request pool_rows / seq_lens / ext_lens / starts [B];
    k/v [T, Hkv, D*] this step's K/V (read instead of the cache at extend offsets) or None;
    tree [B, n, n] bool or None.
    """
    longs = [x.to(torch.int64).contiguous() for x in (pool_rows, seq_lens, ext_lens, starts)]
    if longs[0].numel() and int((longs[3] + longs[2].clamp(min=0)).max()) > q.shape[0]:
        raise ValueError(f"extend rows reach past q's {q.shape[0]} rows (starts {longs[3].tolist()}, "
                         f"extend lengths {longs[2].tolist()})")
    _native_call(q, o, k_buffer, v_buffer, req_to_token, longs, sm_scale, logit_cap, is_causal,
                 k, v, tree)


def _native_call(q, o, k_buffer, v_buffer, req_to_token, longs, sm_scale, logit_cap, is_causal,
                 k=None, v=None, tree=None):
    """``_native_attend`` past its checks: ``longs`` are the int64 contiguous pool rows,
    sequence lengths, extend lengths and starts."""
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    qf = q.to(torch.float32).contiguous()
    direct = o.dtype == torch.float32 and o.is_contiguous()
    out = o if direct else torch.zeros(o.shape, dtype=torch.float32)
    fresh = [None if x is None else x.reshape(x.shape[0], hkv, -1).to(k_buffer.dtype).contiguous()
             for x in (k, v)]
    tree_u8 = None if tree is None else tree.to(torch.uint8).contiguous()
    ptr = lambda x: 0 if x is None else x.data_ptr()  # noqa: E731
    _native.attend(ptr(qf), ptr(out), ptr(k_buffer), ptr(v_buffer), ptr(fresh[0]), ptr(fresh[1]),
                   ptr(req_to_token), *(ptr(x) for x in longs), ptr(tree_u8),
                   0 if tree is None else tree.shape[-1], longs[0].shape[0], q.shape[1], hkv,
                   q.shape[2], dv, req_to_token.stride(0), float(sm_scale), float(logit_cap),
                   k_buffer.dtype == torch.bfloat16, bool(is_causal), kernel_threads())
    if not direct:  # copy back the requests' rows only
        ext, first = longs[2].clamp(min=0), longs[3]
        packed_first = torch.cumsum(ext, 0) - ext  # where each request's rows start if packed
        total = int(ext.sum())
        if total and torch.equal(first, packed_first):  # rows 0 .. total-1
            o[:total].copy_(out[:total])
        elif total:
            rows = torch.repeat_interleave(first - packed_first, ext) + torch.arange(total)
            o.index_copy_(0, rows, out.index_select(0, rows).to(o.dtype))


def _bytes_per_key(k_buffer, v_buffer) -> int:
    return 4 * k_buffer.shape[1] * (k_buffer.shape[2] + v_buffer.shape[2])


def extend_attention_cpu(
    q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
    seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
    is_cross, sliding_window, encoder_lens=None, sinks=None, tree_mask=None, is_causal=True,
):
    """Prefill / extend / verify attention over the whole batch. ``o`` is written in place.

    q [T, H, D], k/v [T, Hkv, D*] (None on KV-shared layers: read from the cache), o [T, H, Dv].
    ``tree_mask`` (TARGET_VERIFY): flat ``bs * n * n`` bool, every request extending by ``n``;
    or ``[bs, n, n]`` for a ragged verify, request b extending by its first
    ``extend_seq_lens[b] <= n`` nodes (the top-left block of its tree).
    """
    _check_features("extend_attention_cpu", is_cross, sliding_window, sinks, k_buffer)
    seq_l, ext_l = seq_lens.tolist(), extend_seq_lens.tolist()
    bsz, lq = len(seq_l), max(ext_l, default=0)
    if lq == 0:
        return
    tree = None
    if tree_mask is not None and tree_mask.dim() == 3:  # ragged: [bs, n, n], n >= every extend
        tree = tree_mask.bool()
    elif tree_mask is not None:
        tree = tree_mask.reshape(-1)[: bsz * lq * lq].view(bsz, lq, lq).bool()
    if _native_fits(q, k_buffer, v_buffer, req_to_token):
        # a tree batch goes native whole; else the requests extending by <= NATIVE_MAX_EXTEND
        short = torch.tensor([tree is not None or n <= NATIVE_MAX_EXTEND for n in ext_l])
        if bool(short.all()):
            _native_attend(q, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                           extend_seq_lens, extend_start_loc, sm_scale, logit_cap, is_causal,
                           k, v, tree)
            return
        if bool(short.any()):  # the short ones native, the rest (prefills) by SDPA below
            _native_attend(q, o, k_buffer, v_buffer, req_to_token, req_pool_indices[short],
                           seq_lens[short], extend_seq_lens[short], extend_start_loc[short],
                           sm_scale, logit_cap, is_causal, k, v)
            rest = ~short
            req_pool_indices, seq_lens = req_pool_indices[rest], seq_lens[rest]
            extend_seq_lens, extend_start_loc = extend_seq_lens[rest], extend_start_loc[rest]
            seq_l, ext_l = seq_lens.tolist(), extend_seq_lens.tolist()
            bsz, lq = len(seq_l), max(ext_l)
    if tree is not None and tree.shape[-1] != lq:  # ragged verify: the block the longest sees
        tree = tree[:, :lq, :lq]
    packed = min(ext_l) == lq and extend_start_loc.tolist() == list(range(0, bsz * lq, lq))
    reqs = _Requests(req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, tree,
                     max(seq_l), lq, packed)
    bytes_per_score = 4 * 3 * q.shape[1]
    for chunk in _chunks(reqs, seq_l, ext_l, _bytes_per_key(k_buffer, v_buffer), bytes_per_score):
        _attend_requests(q, o, k_buffer, v_buffer, req_to_token, chunk,
                         lambda kv_real: _visible(chunk, kv_real, is_causal),
                         sm_scale, logit_cap, k, v)


_DECODE_META = None  # (weakref pool rows, weakref seq_lens, their versions, int64 arrays)


def _decode_meta(req_pool_indices, seq_lens):
    """The int64 per-request arrays a native decode reads (pool rows, lengths, extend lengths
    of 1, starts 0..B-1). Every layer of a forward passes the same two tensors, so they are
    made once per forward: reused while both are the same objects, unmodified."""
    global _DECODE_META
    key = (req_pool_indices._version, seq_lens._version)
    cached = _DECODE_META
    if (cached is not None and cached[0]() is req_pool_indices and cached[1]() is seq_lens
            and cached[2] == key):
        return cached[3]
    bsz = seq_lens.shape[0]
    longs = [req_pool_indices.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(),
             torch.ones(bsz, dtype=torch.int64), torch.arange(bsz, dtype=torch.int64)]
    _DECODE_META = (weakref.ref(req_pool_indices), weakref.ref(seq_lens), key, longs)
    return longs


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] as [T, H * D] without a copy where its heads lie side by side in each
    row (a row view of the fused QKV output does), else unchanged."""
    return x.flatten(1) if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x


def _store_kv(k_buffer, v_buffer, k, v, cache_loc, native: bool) -> None:
    """This step's K/V rows into the cache at ``cache_loc``: one native copy on the native path
    when they are in the cache's dtype with unit inner stride (row views of the fused QKV
    output qualify), else two index writes."""
    rows = cache_loc.shape[0]
    kr, vr = k_buffer[0].numel(), v_buffer[0].numel()
    if k.dim() == 3 and v.dim() == 3 and k.shape[0] == rows and v.shape[0] == rows:
        k, v = _as_rows(k), _as_rows(v)  # [T, Hkv, D] views as sglang's RadixAttention makes
    if (native and k.dtype == k_buffer.dtype and v.dtype == v_buffer.dtype
            and k.dim() == 2 and v.dim() == 2 and k.shape == (rows, kr) and v.shape == (rows, vr)
            and k.stride(1) == 1 and v.stride(1) == 1 and k_buffer.is_contiguous()
            and v_buffer.is_contiguous()):
        loc = cache_loc.to(torch.int64).contiguous()
        size = k.element_size()
        _native.store_kv(k_buffer.data_ptr(), v_buffer.data_ptr(), k.data_ptr(), v.data_ptr(),
                         k.stride(0) * size, v.stride(0) * size, loc.data_ptr(), rows,
                         kr * size, vr * size, k_buffer.shape[0])
        return
    loc = cache_loc.long()
    k_buffer[loc] = k.view(k.shape[0], k_buffer.shape[1], -1).to(k_buffer.dtype)
    v_buffer[loc] = v.view(v.shape[0], v_buffer.shape[1], -1).to(v_buffer.dtype)


def _decode_mask(kv_real):
    """[B, 1, Lk] from the real keys, None when every request has the same length."""
    return None if bool(kv_real.all()) else kv_real.unsqueeze(1)


def decode_attention_cpu(
    q, k_buffer, v_buffer, k_scale, v_scale, o, k, v, cache_loc, attn_logits, req_to_token,
    req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross, sliding_window,
    encoder_lens=None, sinks=None,
):
    """One-token decode attention over the whole batch; writes the new K/V into the cache first.

    q [B, H, D], o [B, H, Dv], k/v [B, Hkv * D*] (or None: already in the cache).
    """
    _check_features("decode_attention_cpu", is_cross, sliding_window, sinks, k_buffer)
    native = _native_fits(q, k_buffer, v_buffer, req_to_token)
    if k is not None and v is not None:
        _store_kv(k_buffer, v_buffer, k, v, cache_loc, native)
    bsz = seq_lens.shape[0]
    if bsz == 0:
        return
    if native:
        if q.shape[0] < bsz or req_pool_indices.shape[0] != bsz:
            raise ValueError(f"decode of {bsz} requests got {q.shape[0]} query rows and "
                             f"{req_pool_indices.shape[0]} pool rows")
        _native_call(q, o, k_buffer, v_buffer, req_to_token,
                     _decode_meta(req_pool_indices, seq_lens), sm_scale, logit_cap, True)
        return
    seq_l = seq_lens.tolist()
    ones = torch.ones(bsz, dtype=torch.long)
    reqs = _Requests(req_pool_indices, seq_lens, ones, torch.arange(bsz), None, max(seq_l), 1,
                     packed=True)
    bytes_per_score = 4 * 3 * q.shape[1]
    for chunk in _chunks(reqs, seq_l, [1] * bsz, _bytes_per_key(k_buffer, v_buffer), bytes_per_score):
        _attend_requests(q, o, k_buffer, v_buffer, req_to_token, chunk, _decode_mask,
                         sm_scale, logit_cap)


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
