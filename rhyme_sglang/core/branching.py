"""Branch points: where a prompt's history offers several continuations after a context, which one
a new response took, and the reward coefficient that best predicts those choices.

A branch point is a context whose longest match in the history (at most `max_match` tokens, the
rule the prompt trie drafts by) is followed there by two or more distinct tokens. Each branch is
the list of history occurrences continuing with its token; the store's trie gives a branch the
weight sum over those occurrences of recency * exp(coef * clip(advantage)), so a new response's
choice at every branch point is evidence on `coef`: `RewardFit` keeps the log-likelihood of the
observed choices on a grid of coefficients and picks the best.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

Occurrence = Tuple[int, int]        # (history sequence, index of the token that continues)
Branches = Dict[int, List[int]]     # continuation token -> history sequence of each occurrence
COEF_GRID = (-0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)


class HistoryIndex:
    """Occurrence index over a prompt's history sequences (read-only once built)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs = [list(s) for s in seqs]
        self._after: Dict[int, List[Occurrence]] = {}
        for r, s in enumerate(self.seqs):
            for i in range(1, len(s)):
                self._after.setdefault(s[i - 1], []).append((r, i))

    def match(self, context: Sequence[int], end: int, max_match: int) -> Tuple[int, List[Occurrence]]:
        """Longest m <= max_match such that context[end - m:end] occurs followed by a token;
        returns (m, those occurrences), (0, []) when even the last token never continues."""
        if end < 1:
            return 0, []
        best, occ = 0, []
        for r, i in self._after.get(context[end - 1], ()):
            s, m = self.seqs[r], 1
            lim = min(max_match, end, i)
            while m < lim and s[i - 1 - m] == context[end - 1 - m]:
                m += 1
            if m > best:
                best, occ = m, [(r, i)]
            elif m == best:
                occ.append((r, i))
        return best, occ

    def extend(self, occ: Sequence[Occurrence], token: int) -> List[Occurrence]:
        """The occurrences that continue with `token` and are followed by one more token."""
        out = []
        for r, i in occ:
            s = self.seqs[r]
            if s[i] == token and i + 1 < len(s):
                out.append((r, i + 1))
        return out

    def branches(self, occ: Sequence[Occurrence]) -> Branches:
        out: Branches = {}
        for r, i in occ:
            out.setdefault(self.seqs[r][i], []).append(r)
        return out


def branch_points(index: HistoryIndex, seq: Sequence[int], start: int,
                  max_match: int) -> Iterator[Tuple[int, Branches]]:
    """(position j, branches) for every j >= start where the history's longest match of
    seq[:j] offers two or more continuations; seq[j] is the one this sequence took."""
    m, occ = 0, []
    for j in range(start, len(seq)):
        if not occ or m > max_match:  # the extended match is the longest one while it exists
            m, occ = index.match(seq, j, max_match)
        if len(occ) > 1:
            br = index.branches(occ)
            if len(br) > 1:
                yield j, br
        occ = index.extend(occ, seq[j])
        m += 1


def branch_loglik(branches: Sequence[np.ndarray], taken: int, coefs: np.ndarray) -> np.ndarray:
    """log P(branch `taken`) for each coefficient, P(b) proportional to sum over b's occurrences
    of exp(log_recency + coef * clipped_advantage). `branches[b]`: [n_b, 2] rows of
    (log recency, clipped advantage)."""
    # scores[b, c] = logsumexp over occurrences of (log_recency + coef_c * adv)
    scores = np.stack([np.logaddexp.reduce(b[:, :1] + b[:, 1:2] * coefs[None, :], axis=0)
                       for b in branches])
    return scores[taken] - np.logaddexp.reduce(scores, axis=0)


class RewardFit:
    """Per-epoch maximum-likelihood choice of the reward coefficient from branch choices.

    `observe` adds one branch point; `close_epoch` discounts older evidence by `memory` and moves
    to the grid coefficient with the highest accumulated log-likelihood when it beats the current
    coefficient by more than `margin` nats (a likelihood-ratio test: weak evidence keeps the
    current coefficient) and at least `min_points` branch points have been seen."""

    def __init__(self, initial: float, memory: float = 0.5, min_points: int = 20,
                 margin: float = 2.0, grid: Sequence[float] = COEF_GRID) -> None:
        self.coef = float(initial)
        self.memory = memory
        self.min_points = min_points
        self.margin = margin
        self.grid = np.asarray(grid, dtype=float)
        self.loglik = np.zeros(len(self.grid))
        self.points = 0.0
        self._epoch_ll = np.zeros(len(self.grid))
        self._epoch_points = 0

    def observe(self, branches: Sequence[np.ndarray], taken: int) -> None:
        self._epoch_ll += branch_loglik(branches, taken, self.grid)
        self._epoch_points += 1

    def close_epoch(self) -> float:
        self.loglik = self.memory * self.loglik + self._epoch_ll
        self.points = self.memory * self.points + self._epoch_points
        self._epoch_ll = np.zeros(len(self.grid))
        self._epoch_points = 0
        best = int(np.argmax(self.loglik))
        current = float(np.interp(self.coef, self.grid, self.loglik))
        if self.points >= self.min_points and self.loglik[best] - current > self.margin:
            self.coef = float(self.grid[best])
        return self.coef

    def summary(self) -> dict:
        return {"coef": self.coef, "points": self.points,
                "loglik": {f"{c:g}": float(v) for c, v in zip(self.grid, self.loglik)}}


def history_features(records: Dict[int, Sequence], epoch: int, decay: float,
                     bound: float) -> Tuple[list, np.ndarray]:
    """The records of epochs < `epoch` and their [n, 2] (log recency, clipped group advantage)
    as seen from `epoch`."""
    from .weights import group_advantages
    old, rows = [], []
    for e in sorted(records):
        if e >= epoch:
            continue
        group = records[e]
        adv = group_advantages({i: r.reward for i, r in enumerate(group)})
        for i, rec in enumerate(group):
            old.append(rec)
            rows.append(((epoch - e) * math.log(decay), max(-bound, min(bound, adv[i]))))
    return old, np.array(rows, dtype=float).reshape(-1, 2)


def observe_epoch(fit: RewardFit, histories: Sequence, epoch: int, decay: float, bound: float,
                  max_match: int, max_tokens: int) -> int:
    """Feed `fit` the branch choices of every prompt's epoch-`epoch` responses against that
    prompt's older records (`histories`: objects with `records` = {epoch: [ResponseRecord]});
    stops after `max_tokens` response tokens and returns how many it walked."""
    walked = 0
    for ph in histories:
        new = ph.records.get(epoch, ())
        old, feats = history_features(ph.records, epoch, decay, bound) if new else ([], None)
        if not old:
            continue
        index = HistoryIndex([r.seq for r in old])
        for rec in new:
            if walked >= max_tokens:
                return walked
            for j, br in branch_points(index, rec.seq, len(rec.seq) - rec.response_len, max_match):
                tokens = list(br)
                if rec.seq[j] in br:
                    fit.observe([feats[br[t]] for t in tokens], tokens.index(rec.seq[j]))
            walked += rec.response_len
    return walked
