"""Lossless sampling-mode verification of a speculative token tree, and seeded draws.

Draft tokens from history are deterministic proposals (their draft distribution is a
point mass), so a verify can draw exactly as plain decoding draws: at a tree node with
target distribution ``p`` it draws one token from ``p`` and accepts the child holding that
token; when no child holds it, the drawn token is the step's bonus token. Each emitted token
is therefore distributed exactly as ``p``, and a child ``x`` is accepted with probability
``p(x)``, as rejection sampling of a point-mass draft accepts it.

Every request has a seed (its ``sampling_seed``, or a random one), and every draw of it, plain
or in a verify, is determined by the seed, the position and the probabilities
(:func:`.seeded.seeded_sample_rows`, an exponential race whose random numbers hash the seed, the
position and the token). So a request decodes the same tokens with or without speculation,
whatever the widths, and the same seed gives the same tokens on every run, up to the rounding
of the verify's and the decode's different kernels, which moves a draw only at a near-tie of
two tokens' races. Unseeded draws (the walk outside a seeded batch) are inverse-CDF draws
(:func:`sample_rows`; ~10x cheaper on CPU than ``torch.multinomial``).

``tree_speculative_sampling_target_only`` has the argument list of sglang's CUDA kernel of
that name (sglang 0.5.23), so sglang's verify code calls it unchanged.

A verify's target rows are filtered exactly as plain decoding filters (sglang's torch sampler:
top-k, top-p over the unfiltered mass and min-p, one joint rule, :func:`filter_row`), not
as sglang's verify does (top-k renormalised, then top-p over the renormalised mass, and no
min-p). :func:`with_verify_filters` hands the batch's filters and seeds to the verify.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Optional

import torch

from rhyme_sglang.cpu_backend.seeded import seeded_sample_rows
from rhyme_sglang.settings import settings


def sampling_impl() -> str:
    """Plain sampling's draw on CPU (``RHYME_CPU_SAMPLING``): ``inverse_cdf`` (the default: ours,
    the seeded race of :mod:`.seeded`, or :func:`sample_rows` without seeds) or ``torch``
    (sglang's ``torch.multinomial``, seeds ignored)."""
    return settings().cpu_sampling


def _as_row_values(values, num_rows: int) -> list:
    if isinstance(values, torch.Tensor):
        flat = values.view(-1).tolist()
        return flat if len(flat) == num_rows else flat * num_rows
    return [values] * num_rows


@dataclass
class VerifyFilters:
    """One verify's sampling filters, per request (None: that filter is off for the batch),
    the tree rows per request (``nodes``), and the draws' seeds with each request's position
    of its root node (``starts``; None: the walk takes sglang's coins)."""

    top_ks: Optional[list]
    top_ps: Optional[list]
    min_ps: Optional[list]
    nodes: int
    applied: bool = False  # the eager path filtered the dense tensor already
    seeds: Optional[list] = None
    starts: Optional[list] = None

    @classmethod
    def of(cls, sampling_info, nodes: int, seq_lens=None) -> "VerifyFilters":
        def values(flag, tensor):
            return tensor.view(-1).tolist() if getattr(sampling_info, flag, False) else None

        seeds = getattr(sampling_info, "sampling_seed", None)
        seeded = seeds is not None and seq_lens is not None
        return cls(values("need_top_k_sampling", sampling_info.top_ks),
                   values("need_top_p_sampling", sampling_info.top_ps),
                   values("need_min_p_sampling", sampling_info.min_ps), int(nodes),
                   seeds=seeds.view(-1).tolist() if seeded else None,
                   starts=seq_lens.view(-1).tolist() if seeded else None)

    def row(self, probs: torch.Tensor, r: int) -> torch.Tensor:
        """Row ``r`` of the flat ``[bs * nodes, vocab]`` target, filtered."""
        b = r // self.nodes
        return filter_row(probs, None if self.top_ks is None else self.top_ks[b],
                          None if self.top_ps is None else self.top_ps[b],
                          None if self.min_ps is None else self.min_ps[b])

    def seeded(self) -> bool:
        return self.seeds is not None




_FILTERS: contextvars.ContextVar = contextvars.ContextVar("rhyme_verify_filters", default=None)


def with_verify_filters(eagle_sample):
    """sglang's ``eagle_sample`` (the verify), with the batch's sampling filters handed to the
    target probabilities it computes (:func:`lazy_verify_softmax`) and its seeds to the tree
    walk (the root of request ``b`` sits at ``batch.seq_lens[b]``)."""

    def sample(verify_input, batch, *args, **kwargs):
        filters = VerifyFilters.of(batch.sampling_info, verify_input.draft_token_num,
                                   getattr(batch, "seq_lens", None))
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
    handful of rows used (such verify steps were measured at 0.9-1.3 s against 0.2 s for a
    plain step). A row here is the same computation on that row alone: ``softmax(logits /
    temperature)``, then the request's filters (:meth:`VerifyFilters.row`), so every emitted
    token keeps its exact distribution. ``torch.zeros_like`` of it gives None (the draft
    probabilities of deterministic drafts).
    """

    def __init__(self, logits: torch.Tensor, temperatures, softmax, filters: VerifyFilters):
        self.logits, self.softmax, self.filters = logits, softmax, filters
        rows = logits.shape[0]
        self.temperatures = (None if temperatures is None
                             else temperatures.reshape(-1, 1).expand(rows, 1))
        self.nodes = None  # n after view(bs, n, -1)
        self._rows: dict = {}

    @property
    def shape(self):
        rows, vocab = self.logits.shape
        return (rows, vocab) if self.nodes is None else (rows // self.nodes, self.nodes, vocab)

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
            out = self._rows[r] = self.filters.row(out[0], r)
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


def _verify_filters(what: str) -> VerifyFilters:
    filters = _FILTERS.get()
    if filters is None:
        raise RuntimeError(f"{what} runs inside a verify only (sampling.with_verify_filters)")
    return filters


def lazy_verify_softmax(softmax):
    """sglang's verify softmax (``eagle_utils.sampling_softmax``), inside
    :func:`with_verify_filters`: :class:`VerifyProbs` (rows computed, and filtered as plain
    decoding filters, when read), or the dense filtered tensor when sglang's NaN probes are on
    (they read the whole tensor) or ``RHYME_CPU_SAMPLING=torch``."""

    def verify_softmax(logits, temperatures=None):
        from sglang.srt.environ import envs

        filters = _verify_filters("the verify softmax")
        if (sampling_impl() == "torch" or envs.SGLANG_ENABLE_NAN_LOGITS_CHECK.get()
                or envs.SGLANG_ENABLE_ASYNC_ASSERT.get()):
            probs = softmax(logits, temperatures=temperatures)
            probs = torch.stack([filters.row(probs[r], r) for r in range(probs.shape[0])])
            filters.applied = True
            return probs
        return VerifyProbs(logits, temperatures, softmax, filters)

    return verify_softmax


def verify_renorm(probs, values):
    """sglang's top-k and top-p renorms of a verify's target rows (``eagle_utils``'s
    ``top_k_renorm_prob`` and ``top_p_renorm_prob``): the rows are filtered already, by plain
    decoding's joint rule (:class:`VerifyProbs` when a row is read, the dense tensor at
    once), so they stay as they are."""
    filters = _verify_filters("a verify renorm")
    if not (isinstance(probs, VerifyProbs) or filters.applied):
        raise RuntimeError("a verify renorm got target rows the verify softmax did not make")
    return probs


def sample_rows(probs: torch.Tensor, coins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of ``probs [B, V]``, drawn exactly: ``[B, 1]`` int64, as
    ``torch.multinomial(probs, 1)`` returns (rows need not be normalised).

    Inverse CDF in vocabulary order, float64: a coin per row (``coins [B]`` in [0, 1), or
    fresh random ones), scaled by the row's mass and kept strictly below it, then a binary
    search (``right=True``, so a token of zero mass, whose cumulative sum equals its
    predecessor's, is never chosen). On CPU ``torch.multinomial`` costs ~1.8 ms a row at
    SmolLM2's 49152-token vocabulary (118 ms at batch 64, 18% of a temperature-1.0 rollout
    step); this costs ~0.1 ms a row.
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_rows: probs must be [batch, vocab], got shape {tuple(probs.shape)}")
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if coins is None:
        coins = torch.rand(total.shape, dtype=torch.float64, device=probs.device)
    elif coins.numel() != probs.shape[0]:
        raise ValueError(f"sample_rows: {coins.numel()} coins for {probs.shape[0]} rows")
    coins = coins.to(torch.float64).view(-1, 1) * total
    coins = torch.minimum(coins, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, coins, right=True)


def draw(row: torch.Tensor, coin: float) -> int:
    """:func:`sample_rows` on one row ``[V]`` with the given coin."""
    return int(sample_rows(row.view(1, -1), torch.tensor([float(coin)], dtype=torch.float64)))


def sample_filtered_rows(probs: torch.Tensor, top_ks, top_ps, min_ps, seeds=None,
                         positions=None) -> torch.Tensor:
    """Plain decoding's top-k / top-p / min-p draw (:func:`filter_row` per row, the rows a
    verify draws from), seeded (:func:`seeded_sample_rows`) when ``seeds`` are given, else
    :func:`sample_rows`. ``min_ps`` None: no min-p. ``[B]`` int32."""
    rows = probs.shape[0]
    ks, ps = _as_row_values(top_ks, rows), _as_row_values(top_ps, rows)
    mins = [None] * rows if min_ps is None else _as_row_values(min_ps, rows)
    filtered = torch.stack([filter_row(probs[r], ks[r], ps[r], mins[r]) for r in range(rows)])
    out = (sample_rows(filtered) if seeds is None
           else seeded_sample_rows(filtered, seeds, positions))
    return out.view(-1).to(torch.int32)


def tree_speculative_sampling_target_only(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
    draft_probs=None, threshold_single: float = 1.0, threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Verify ``bs`` draft trees against ``target_probs [bs, n, vocab]``, in place.

    From the root down, each node draws its token: inside :func:`with_verify_filters` when the
    batch has seeds, the seeded draw of its position (:func:`seeded_sample_rows`, the draw plain
    decoding makes there), else :func:`draw` with ``uniform_samples[b, node]``. The child
    holding the drawn token is accepted and the walk
    goes on from it; otherwise (or after ``num_spec - 1`` accepted drafts) the drawn token is
    the bonus. Writes ``predicts[flat node]`` (the token emitted after each accepted node),
    ``accept_index[b, :]`` (flat indices of the root and the accepted nodes) and
    ``accept_token_num[b]`` (accepted draft tokens, bonus excluded). Thresholds other than
    1.0 make acceptance lossy and are refused; ``uniform_samples_for_final_sampling`` is not
    needed (the bonus is the last node's draw).
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
    rule = _FILTERS.get()
    seeded = rule is not None and rule.seeded()
    probs = target_probs.view(bs, n, -1)
    last = [r_index[b][0] for b in range(bs)]
    node, depth = [0] * bs, 0
    active = list(range(bs))
    for b in active:
        accept_index[b, 0] = last[b]
    while active:  # one depth of every request still walking: its draws in one batch
        rows = [probs[b, node[b]] for b in active]
        if seeded:
            tokens = seeded_sample_rows(
                torch.stack(rows), [rule.seeds[b] for b in active],
                [rule.starts[b] + depth for b in active]).view(-1).tolist()
        else:
            tokens = [draw(row, coins[b][node[b]]) for b, row in zip(active, rows)]
        walking = []
        for b, token in zip(active, tokens):
            child = r_next[b][node[b]] if depth + 1 < num_spec else -1
            while child != -1 and cand[b][child] != token:
                child = r_sib[b][child]
            predicts[last[b]] = token
            if child == -1:  # the draw is the bonus token
                accept_token_num[b] = depth
                continue
            last[b], node[b] = r_index[b][child], child
            accept_index[b, depth + 1] = last[b]
            walking.append(b)
        active, depth = walking, depth + 1
