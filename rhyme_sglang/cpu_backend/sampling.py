"""Lossless sampling-mode verification of a speculative token tree, seeded draws, prob renorms.

Draft tokens from history are deterministic proposals (their draft distribution is a
point mass), so a verify can draw exactly as plain decoding draws: at a tree node with
target distribution ``p`` it draws one token from ``p`` with that position's coin and
accepts the child holding that token; when no child holds it, the drawn token is the
step's bonus token. Each emitted token is therefore distributed exactly as ``p``, and a
child ``x`` is accepted with probability ``p(x)``, as rejection sampling of a point-mass
draft accepts it.

Every draw, plain or in a verify, is one inverse-CDF draw in vocabulary order
(:func:`sample_rows`; ~10x cheaper on CPU than ``torch.multinomial``), and its coin is a
function of the request's seed and the token's position (:func:`seeded_coin`). So a
request decodes the same tokens with or without speculation, whatever the widths, and
the same seed gives the same tokens on every run (up to the rounding of the verify's and
the decode's different kernels, which moves a draw only when its coin falls within ~1e-6
of a boundary of the CDF). A request without a ``sampling_seed`` gets a random one.

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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer to a well-mixed 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_coin(seed: int, position: int) -> float:
    """The coin in [0, 1) (53 bits) that draws a request's token from the logits at
    ``position`` (the position of the token fed to the model; the drawn one goes next)."""
    return (_mix64(_mix64(int(seed) & _MASK64) ^ (int(position) & _MASK64)) >> 11) * 2.0 ** -53


def seeded_coins(seeds, positions) -> torch.Tensor:
    """:func:`seeded_coin` per row (``seeds`` and ``positions`` lists or tensors), float64."""
    if isinstance(seeds, torch.Tensor):
        seeds = seeds.view(-1).tolist()
    if isinstance(positions, torch.Tensor):
        positions = positions.view(-1).tolist()
    if len(seeds) != len(positions):
        raise ValueError(f"seeded_coins: {len(seeds)} seeds for {len(positions)} positions")
    return torch.tensor([seeded_coin(s, p) for s, p in zip(seeds, positions)], dtype=torch.float64)


def request_seed(req) -> int:
    """The seed of a request's draws: its ``sampling_seed``, or a random one drawn once (from
    torch's generator, so sglang's ``--random-seed`` fixes it) and kept on the request."""
    seed = req.sampling_params.sampling_seed
    if seed is None:
        seed = getattr(req, "rhyme_seed", None)
        if seed is None:
            seed = req.rhyme_seed = int(torch.randint(0, 2**62, (1,)))
    return int(seed)


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

    def coin(self, b: int, depth: int) -> Optional[float]:
        """Request ``b``'s coin for the node at ``depth`` of its tree, or None (unseeded)."""
        if self.seeds is None:
            return None
        return seeded_coin(self.seeds[b], self.starts[b] + depth)


_FILTERS: contextvars.ContextVar = contextvars.ContextVar("rhyme_verify_filters", default=None)


def with_verify_filters(eagle_sample):
    """sglang's ``eagle_sample`` (the verify), with the batch's sampling filters handed to the
    target probabilities it computes (:func:`lazy_verify_softmax`) and its seeds to the tree
    walk (the root of request ``b`` sits at ``batch.seq_lens[b]``)."""

    def sample(verify_input, batch, *args, **kwargs):
        info = getattr(batch, "sampling_info", None)
        filters = (None if info is None else
                   VerifyFilters.of(info, verify_input.draft_token_num, getattr(batch, "seq_lens", None)))
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


def sample_filtered_rows(probs: torch.Tensor, top_ks, top_ps, min_ps,
                         coins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain decoding's top-k / top-p / min-p draw (:func:`filter_row` per row, then
    :func:`sample_rows`): the rows a verify draws from, so a seeded request draws the same
    token with or without speculation. ``min_ps`` None: no min-p. ``[B]`` int32."""
    rows = probs.shape[0]
    ks, ps = _as_row_values(top_ks, rows), _as_row_values(top_ps, rows)
    mins = [None] * rows if min_ps is None else _as_row_values(min_ps, rows)
    filtered = torch.stack([filter_row(probs[r], ks[r], ps[r], mins[r]) for r in range(rows)])
    return sample_rows(filtered, coins).view(-1).to(torch.int32)


def tree_speculative_sampling_target_only(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
    draft_probs=None, threshold_single: float = 1.0, threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Verify ``bs`` draft trees against ``target_probs [bs, n, vocab]``, in place.

    From the root down, each node draws its token (:func:`draw`) with its coin: the seeded
    coin of its position inside :func:`with_verify_filters` when the batch has seeds, else
    ``uniform_samples[b, node]``. The child holding the drawn token is accepted and the walk
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
    probs = target_probs.view(bs, n, -1)
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        node = depth = 0
        while True:
            coin = None if rule is None else rule.coin(b, depth)
            token = draw(probs[b, node], coins[b][node] if coin is None else coin)
            if depth + 1 >= num_spec:
                break
            child = r_next[b][node]
            while child != -1 and cand[b][child] != token:
                child = r_sib[b][child]
            if child == -1:
                break
            predicts[last] = token
            depth += 1
            last = r_index[b][child]
            accept_index[b, depth] = last
            node = child
        predicts[last] = token
        accept_token_num[b] = depth
