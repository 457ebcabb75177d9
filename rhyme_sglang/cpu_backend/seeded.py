"""Seeded draws: a request's token at a position is a function of its seed, the position and
the target probabilities, whatever kernel computed them.

:func:`seeded_sample_rows` is an exponential race (Gumbel-max) whose random numbers hash the
seed, the position and the token; :func:`request_seed` gives every request a seed. Plain
decoding (``patches.fast_cpu_sampling``) and the verify's tree walk
(:func:`.sampling.tree_speculative_sampling_target_only`) both draw with it, so a seeded
request decodes the same tokens with or without speculation.
"""

from __future__ import annotations

import hashlib
import math

import torch

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
