"""Lossless sampling-mode verification of a speculative token tree, and prob renorms.

Draft tokens from history are deterministic proposals (their draft distribution is a
point mass), so the exact rule is: at a tree node with target distribution ``p``, walk
the children ``x_1, x_2, ...`` in order with one uniform coin ``u`` and accept ``x_i`` when
``u < p(x_1) + ... + p(x_i)`` - equivalently, accept ``x_1`` with probability ``p(x_1)``,
otherwise ``x_2`` with probability ``p(x_2) / (1 - p(x_1))``, and so on. When every child
is rejected, the bonus token is drawn from ``p`` with the rejected tokens zeroed and
renormalised. Each emitted token is therefore distributed exactly as ``p``.

Plain decoding's draw (:func:`sample_rows`, used for sglang's temperature-only sampling on
CPU) is an exact inverse-CDF draw too, ~10x cheaper than ``torch.multinomial`` here.

``tree_speculative_sampling_target_only`` has the argument list of sglang's CUDA kernel of
that name (sglang 0.5.23), so sglang's verify code calls it unchanged.

A verify's target rows are filtered exactly as plain decoding filters (sglang's torch sampler:
top-k, top-p over the unfiltered mass and min-p, one joint rule, :func:`filter_row`), not
as sglang's verify does (top-k renormalised, then top-p over the renormalised mass, and no
min-p). :func:`with_verify_filters` hands the batch's filters to the verify.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Optional

import torch

from rhyme_sglang.machine import env_choice

SAMPLING_IMPLS = ("inverse_cdf", "torch")


def sampling_impl() -> str:
    """Plain sampling's draw on CPU (``RHYME_CPU_SAMPLING``): ``inverse_cdf`` (the default,
    :func:`sample_rows`) or ``torch`` (sglang's ``torch.multinomial``)."""
    return env_choice("RHYME_CPU_SAMPLING", SAMPLING_IMPLS, "inverse_cdf")


def _as_row_values(values, num_rows: int) -> list:
    if isinstance(values, torch.Tensor):
        flat = values.view(-1).tolist()
        return flat if len(flat) == num_rows else flat * num_rows
    return [values] * num_rows


@dataclass
class VerifyFilters:
    """One verify's sampling filters, per request (None: that filter is off for the batch),
    and the tree rows per request (``nodes``)."""

    top_ks: Optional[list]
    top_ps: Optional[list]
    min_ps: Optional[list]
    nodes: int
    applied: bool = False  # the eager path filtered the dense tensor already

    @classmethod
    def of(cls, sampling_info, nodes: int) -> "VerifyFilters":
        def values(flag, tensor):
            return tensor.view(-1).tolist() if getattr(sampling_info, flag, False) else None

        return cls(values("need_top_k_sampling", sampling_info.top_ks),
                   values("need_top_p_sampling", sampling_info.top_ps),
                   values("need_min_p_sampling", sampling_info.min_ps), int(nodes))

    def row(self, probs: torch.Tensor, r: int) -> torch.Tensor:
        """Row ``r`` of the flat ``[bs * nodes, vocab]`` target, filtered."""
        b = r // self.nodes
        return filter_row(probs, None if self.top_ks is None else self.top_ks[b],
                          None if self.top_ps is None else self.top_ps[b],
                          None if self.min_ps is None else self.min_ps[b])


_FILTERS: contextvars.ContextVar = contextvars.ContextVar("rhyme_verify_filters", default=None)


def with_verify_filters(eagle_sample):
    """sglang's ``eagle_sample`` (the verify), with the batch's sampling filters handed to the
    target probabilities it computes (:func:`lazy_verify_softmax`)."""

    def sample(verify_input, batch, *args, **kwargs):
        info = getattr(batch, "sampling_info", None)
        filters = None if info is None else VerifyFilters.of(info, verify_input.draft_token_num)
        token = _FILTERS.set(filters)
        try:
            return eagle_sample(verify_input, batch, *args, **kwargs)
        finally:
            _FILTERS.reset(token)

    sample.__wrapped__ = eagle_sample
    return sample


def filter_row(probs: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The distribution plain decoding draws from, for one row of ``probs`` (normalised).

    sglang's torch sampler, as one joint rule: in descending order a token is kept when its
    rank is below ``top_k``, the unfiltered mass before it is at most ``top_p``, and its
    probability is at least ``min_p`` times the largest; the kept mass is renormalised. The
    kept tokens are a head of the order, so only a head is sorted: 128 tokens, 4x more while
    the head does not decide the row."""
    vocab = probs.numel()
    limit = int(top_k) if top_k is not None and 0 < int(top_k) < vocab else vocab
    use_p = top_p is not None and float(top_p) < 1.0
    use_min = min_p is not None and float(min_p) > 0.0
    if limit == vocab and not use_p and not use_min:
        return probs
    n = min(limit, 128)
    while True:
        vals, idx = torch.topk(probs, n, sorted=True)
        keep = torch.ones(n, dtype=torch.bool)
        decided = n == limit
        if use_p:
            cum = torch.cumsum(vals, 0)
            keep &= (cum - vals) <= float(top_p)
            decided |= bool(cum[-1] > float(top_p))  # every later token has more before it
        if use_min:
            floor = vals[0] * float(min_p)
            keep &= vals >= floor
            decided |= bool(vals[-1] < floor)  # every later token is below it too
        if decided:
            break
        n = min(limit, 4 * n)
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out / out.sum()


class VerifyProbs:
    """The target probabilities of a sampled verify step, ``[rows, vocab]`` (or ``[bs, n,
    vocab]`` after :meth:`view`), computed one row at a time when a row is read.

    sglang's verify takes a temperature softmax of every tree node's logits, renormalises every
    row for top-k / top-p and allocates a ``zeros_like`` of the result for draft probabilities
    the target-only rule never reads. The tree walk reads only the rows of the root and of the
    nodes it accepts, so at batch 50 and 17 nodes a request that is ~200 MB a tensor for a
    handful of rows used (stop 29 measured such verify steps at 0.9-1.3 s against 0.2 s for a
    plain step). A row here is the same computation on that row alone: ``softmax(logits /
    temperature)``, then :func:`top_k_renorm_prob` and :func:`top_p_renorm_prob` with the
    row's own k and p, so every emitted token keeps its exact distribution.
    ``torch.zeros_like`` of it gives None (the draft probabilities of deterministic drafts).
    """

    def __init__(self, logits: torch.Tensor, temperatures, softmax,
                 filters: Optional[VerifyFilters] = None):
        self.logits, self.softmax, self.filters = logits, softmax, filters
        rows = logits.shape[0]
        self.temperatures = (None if temperatures is None
                             else temperatures.reshape(-1, 1).expand(rows, 1))
        self.top_ks = self.top_ps = None
        self.nodes = None  # n after view(bs, n, -1)
        self._rows: dict = {}

    @property
    def shape(self):
        rows, vocab = self.logits.shape
        return (rows, vocab) if self.nodes is None else (rows // self.nodes, self.nodes, vocab)

    def with_top_k(self, top_ks) -> "VerifyProbs":
        if self.filters is None:  # with filters, the joint rule applies them (row)
            self.top_ks = _as_row_values(top_ks, self.logits.shape[0])
        return self

    def with_top_p(self, top_ps) -> "VerifyProbs":
        if self.filters is None:
            self.top_ps = _as_row_values(top_ps, self.logits.shape[0])
        return self

    def view(self, *shape) -> "VerifyProbs":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        rows = self.logits.shape[0]
        if len(shape) == 3 and shape[0] * shape[1] == rows:
            self.nodes = int(shape[1])
        elif len(shape) == 2 and shape[0] in (rows, -1):
            self.nodes = None
        else:
            raise ValueError(f"VerifyProbs: cannot view {rows} rows as {tuple(shape)}")
        return self

    reshape = view

    def row(self, r: int) -> torch.Tensor:
        out = self._rows.get(r)
        if out is None:
            temps = None if self.temperatures is None else self.temperatures[r : r + 1]
            out = self.softmax(self.logits[r : r + 1], temperatures=temps)
            if self.filters is not None:
                out = self.filters.row(out[0], r)[None]
            if self.top_ks is not None:
                out = top_k_renorm_prob(out, self.top_ks[r])
            if self.top_ps is not None:
                out = top_p_renorm_prob(out, self.top_ps[r])
            out = self._rows[r] = out[0]
        return out

    def __getitem__(self, index):
        if self.nodes is not None and isinstance(index, tuple) and len(index) == 2:
            return self.row(int(index[0]) * self.nodes + int(index[1]))
        if isinstance(index, int):
            return self.row(index)
        raise TypeError(f"VerifyProbs: unsupported index {index!r}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.zeros_like:
            return None
        raise TypeError(f"VerifyProbs supports row reads only, not {getattr(func, '__name__', func)}")


def lazy_verify_softmax(softmax):
    """sglang's verify softmax (``eagle_utils.sampling_softmax``), returning
    :class:`VerifyProbs` (rows computed when read) unless sglang's NaN probes are on (they
    read the whole tensor) or ``RHYME_CPU_SAMPLING=torch``. Inside :func:`with_verify_filters`
    the rows are filtered as plain decoding filters, and sglang's renorm calls after it keep
    them as they are."""

    def verify_softmax(logits, temperatures=None):
        from sglang.srt.environ import envs

        filters = _FILTERS.get()
        if (sampling_impl() == "torch" or envs.SGLANG_ENABLE_NAN_LOGITS_CHECK.get()
                or envs.SGLANG_ENABLE_ASYNC_ASSERT.get()):
            probs = softmax(logits, temperatures=temperatures)
            if filters is not None:
                probs = torch.stack([filters.row(probs[r], r) for r in range(probs.shape[0])])
                filters.applied = True
            return probs
        return VerifyProbs(logits, temperatures, softmax, filters)

    return verify_softmax


def _filtered_already() -> bool:
    filters = _FILTERS.get()
    return filters is not None and filters.applied


def top_k_renorm_prob(probs: torch.Tensor, top_ks) -> torch.Tensor:
    """Keep each row's ``k`` most probable tokens (rank < k) and renormalise."""
    if isinstance(probs, VerifyProbs):
        return probs.with_top_k(top_ks)
    if _filtered_already():
        return probs
    ks = _as_row_values(top_ks, probs.shape[0])
    out = probs.clone()
    vocab = probs.shape[-1]
    for row, k in enumerate(ks):
        k = int(k)
        if 0 < k < vocab:
            kth = torch.topk(probs[row], k, sorted=True).indices
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[kth] = True
            out[row].masked_fill_(~keep, 0.0)
    return out / out.sum(-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_ps) -> torch.Tensor:
    """Keep the smallest head of each row whose exclusive cumulative mass is <= p.

    Matches sglang's torch sampler: a token is dropped when the mass strictly before it
    in descending order exceeds ``top_p``. Rows are sorted only as far as needed: the head
    of the ``k`` most probable tokens decides a row once its total mass exceeds ``p`` (every
    later token then has more than ``p`` before it); ``k`` grows 4x for the undecided rows.
    Rows with ``p >= 1`` keep every token.
    """
    if isinstance(probs, VerifyProbs):
        return probs.with_top_p(top_ps)
    if _filtered_already():
        return probs
    num_rows, vocab = probs.shape
    ps = torch.tensor(_as_row_values(top_ps, num_rows), dtype=probs.dtype)
    keep = (ps >= 1.0).view(-1, 1).repeat(1, vocab)
    pending, k = (ps < 1.0).nonzero().view(-1), min(vocab, 128)
    while pending.numel():
        head, order = torch.topk(probs[pending], k, dim=-1, sorted=True)
        cum = torch.cumsum(head, dim=-1)
        done = (cum[:, -1] > ps[pending]) | (k == vocab)
        rows = pending[done]
        kept = (cum - head)[done] <= ps[rows].view(-1, 1)
        keep[rows] = keep[rows].scatter_(1, order[done], kept)
        pending, k = pending[~done], min(vocab, 4 * k)
    out = probs.masked_fill(~keep, 0.0)
    return out / out.sum(-1, keepdim=True)


def sample_rows(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [B, V]``, drawn exactly: ``[B, 1]`` int64, as
    ``torch.multinomial(probs, 1)`` returns (rows need not be normalised).

    Inverse CDF in float64: one uniform coin per row, scaled by the row's mass and kept
    strictly below it, then a binary search (``right=True``, so a token of zero mass, whose
    cumulative sum equals its predecessor's, is never chosen). On CPU ``torch.multinomial``
    costs ~1.8 ms a row at SmolLM2's 49152-token vocabulary (118 ms at batch 64, 18% of a
    temperature-1.0 rollout step); this costs ~0.1 ms a row.
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_rows: probs must be [batch, vocab], got shape {tuple(probs.shape)}")
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    coins = torch.rand(total.shape, dtype=torch.float64, device=probs.device) * total
    coins = torch.minimum(coins, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, coins, right=True)


def sample_residual(dist: torch.Tensor, coin: float) -> int:
    """Inverse-CDF draw from an unnormalised non-negative vector with ``coin`` in [0, 1)."""
    cdf = torch.cumsum(dist.double(), dim=0)
    total = float(cdf[-1])
    if total <= 0.0:
        raise ValueError("sample_residual: the distribution has no mass left")
    idx = int(torch.searchsorted(cdf, torch.tensor([coin * total], dtype=cdf.dtype), right=True))
    if idx >= dist.numel() or dist[idx] <= 0:
        idx = int(torch.nonzero(dist > 0)[-1])
    return idx


def tree_speculative_sampling_target_only(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
    draft_probs=None, threshold_single: float = 1.0, threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Verify ``bs`` draft trees against ``target_probs [bs, n, vocab]``, in place.

    Writes ``predicts[flat node]`` (the token emitted after each accepted node),
    ``accept_index[b, :]`` (flat indices of the root and the accepted nodes) and
    ``accept_token_num[b]`` (accepted draft tokens, bonus excluded). Thresholds other than
    1.0 make acceptance lossy and are refused.
    """
    if threshold_single != 1.0 or threshold_acc != 1.0:
        raise ValueError(
            f"lossy acceptance thresholds are not supported: threshold_single={threshold_single}, "
            f"threshold_acc={threshold_acc} (both must be 1.0)"
        )
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    coins = uniform_samples.view(bs, n).tolist()
    final_coins = uniform_samples_for_final_sampling.view(-1).tolist()
    probs = target_probs.view(bs, n, -1)
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        node, num_accepted, rejected = 0, 0, []
        for _ in range(1, num_spec):
            child = r_next[b][node]
            row, coin, mass, rejected = probs[b, node], coins[b][node], 0.0, []
            accepted = False
            while child != -1:
                token = cand[b][child]
                if token not in rejected:
                    mass += float(row[token])
                    if coin < mass:
                        accepted = True
                        break
                    rejected.append(token)
                child = r_sib[b][child]
            if not accepted:
                break
            predicts[last] = token
            num_accepted += 1
            last = r_index[b][child]
            accept_index[b, num_accepted] = last
            node, rejected = child, []
        residual = probs[b, node].clone()
        if rejected:
            residual[torch.tensor(rejected, dtype=torch.long)] = 0.0
        predicts[last] = sample_residual(residual, final_coins[b])
        accept_token_num[b] = num_accepted
