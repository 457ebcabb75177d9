"""Lossless sampling-mode verification of a speculative token tree, and seeded draws.

Draft tokens from history are deterministic proposals (their draft distribution is a
point mass), so a verify can draw exactly as plain decoding draws: at a tree node with
target distribution ``p`` it draws one token from ``p`` and accepts the child holding that
token; when no child holds it, the drawn token is the step's bonus token. Each emitted token
is therefore distributed exactly as ``p``, and a child ``x`` is accepted with probability
``p(x)``, as rejection sampling of a point-mass draft accepts it.

Every request has a seed (its ``sampling_seed``, or a random one), and every draw of it, plain
or in a verify, is determined by the seed, the position and the probabilities
(:func:`seeded_sample_rows`, an exponential race whose random numbers hash the seed, the
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
import hashlib
import math
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


def draw_key(seed: int, position: int) -> int:
    """The 64-bit key of a request's draw from the logits at ``position`` (the position of the
    token fed to the model; the drawn one goes next): every random number of that draw is a
    hash of it (:func:`seeded_sample_rows`)."""
    return _mix64(_mix64(int(seed) & _MASK64) ^ (int(position) & _MASK64))


HEAD_SHARE = 2.0 ** -12  # a token of a row's head has at least this share of the row's mass
_M32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9
_TAIL_STREAM, _TAIL_PICK_STREAM = 0xD1B54A32D192ED03, 0x2545F4914F6CDD1D


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values (products wrap mod
    2^64, and the mask keeps their low 32 bits exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _token_exponentials(keys: list, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """One Exp(1) variable per (row, token), a hash of the row's key and the token id (float64)."""
    lo = torch.tensor([k & _M32 for k in keys], dtype=torch.int64)[rows]
    hi = torch.tensor([k >> 32 for k in keys], dtype=torch.int64)[rows]
    h = _fmix32(lo ^ _fmix32((cols * _GOLDEN32 + hi) & _M32))
    return -torch.log((h.double() + 0.5) * 2.0 ** -32)


def _key_exponential(key: int) -> float:
    return -math.log(((_mix64(key) >> 11) + 0.5) * 2.0 ** -53)


def seeded_sample_rows(probs: torch.Tensor, seeds, positions) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (rows need not be normalised), drawn exactly and
    determined by the row's :func:`draw_key`: ``[B, 1]`` int64.

    An exponential race: token ``t`` gets ``E_t / p_t`` with ``E_t ~ Exp(1)`` hashed from the key
    and ``t``, and the smallest wins (with probability ``p_t / sum(p)``; Gumbel-max in other
    words). Only the row's head (tokens with at least :data:`HEAD_SHARE` of its mass, a few
    dozen at temperature 1.0) races token by token; the rest runs as one block of mass ``T``
    with its own ``E / T`` (the minimum of the tail's races is distributed so, independently of
    which tail token attains it), and only when the block wins is the tail's own race run.

    A draw then depends on the probabilities only through comparisons of ratios, so the
    rounding of different kernels (a verify's rows against a decode's) moves a draw only at a
    near-tie, unlike an inverse CDF in vocabulary order, where ~49k cumulative boundaries
    carry that rounding (measured on SmolLM2's rows with the logits perturbed by 1e-6
    relative: 3.6e-3 of inverse-CDF draws moved).
    """
    if probs.dim() != 2:
        raise ValueError(f"seeded_sample_rows: probs must be [batch, vocab], got shape {tuple(probs.shape)}")
    if isinstance(seeds, torch.Tensor):
        seeds = seeds.view(-1).tolist()
    if isinstance(positions, torch.Tensor):
        positions = positions.view(-1).tolist()
    num_rows = probs.shape[0]
    if not len(seeds) == len(positions) == num_rows:
        raise ValueError(f"seeded_sample_rows: {len(seeds)} seeds and {len(positions)} positions "
                         f"for {num_rows} rows")
    keys = [draw_key(s, p) for s, p in zip(seeds, positions)]
    total = probs.sum(-1)
    floor = (total * HEAD_SHARE).unsqueeze(-1)
    rows, cols = (probs >= floor).nonzero(as_tuple=True)
    head_p = probs[rows, cols].double()
    ratio = _token_exponentials(keys, rows, cols) / head_p
    best = torch.full((num_rows,), math.inf, dtype=torch.float64)
    best = best.scatter_reduce(0, rows, ratio, "amin")
    choice = torch.full((num_rows,), -1, dtype=torch.int64)
    won = ratio == best[rows]
    choice[rows[won]] = cols[won]
    head_mass = torch.zeros(num_rows, dtype=torch.float64).index_add_(0, rows, head_p)
    tail = (total.double() - head_mass).tolist()
    best = best.tolist()
    for r in range(num_rows):
        if tail[r] > 0 and _key_exponential(keys[r] ^ _TAIL_STREAM) / tail[r] < best[r]:
            row = probs[r]
            rest = ((row > 0) & (row < floor[r])).nonzero().view(-1)
            if rest.numel():
                e = _token_exponentials([keys[r] ^ _TAIL_PICK_STREAM], torch.zeros_like(rest), rest)
                choice[r] = rest[torch.argmin(e / row[rest].double())]
    return choice.view(-1, 1)


def request_seed(req) -> int:
    """The seed of a request's draws: its ``sampling_seed``, or one drawn once and kept on the
    request: a draw of torch's generator (sglang's ``--random-seed`` fixes it) mixed with the
    request id, so engines started with the same ``--random-seed`` still draw apart."""
    seed = req.sampling_params.sampling_seed
    if seed is None:
        seed = getattr(req, "rhyme_seed", None)
        if seed is None:
            rid = hashlib.blake2b(str(getattr(req, "rid", "")).encode(), digest_size=8).digest()
            draw = int(torch.randint(0, 2**62, (1,))) ^ int.from_bytes(rid, "little")
            seed = req.rhyme_seed = _mix64(draw) >> 1  # an int64
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
    handful of rows used (stop 29 measured such verify steps at 0.9-1.3 s against 0.2 s for a
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
