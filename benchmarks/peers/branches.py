"""Branch points under replay: the ranking oracle (the ceiling of any branch-ranking rule) and the
analysis of which branch the reference takes where the prompt's history offers several.

`RankOracleSource` is the rhyme store with one hindsight change: at every node of the draft on
the reference's path, the child the reference continues with trades weights with its heaviest
sibling (in each trie), so it ranks first. Candidates, budget, probabilities per rank and the
tree-building rule are unchanged; only the order of siblings is. Its tau bounds every rule that
re-ranks branches (reward weighting included).

`BranchAnalysis` replays the plain rhyme store and, at each verify step, walks the reference
from the prompt history's longest context match (the prompt trie's rule): where the history
continues with two or more tokens it records the branches (the history responses behind each,
their group-relative advantages and epoch ages) and which one the reference takes; it also
drafts with the oracle at the same position to count the tokens the ranking lost.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import numpy as np

from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core.branching import COEF_GRID, HistoryIndex, branch_loglik, history_features
from rhyme_sglang.core.draft import Draft, accepted_length
from rhyme_sglang.core.pytree import PySuffixTrie
from rhyme_sglang.core.trace import TraceRecord

from .base import request_id
from .rhyme import RhymeSource

ADV_BINS = (0.0, 0.5, 1.0, 2.0, math.inf)      # |advantage difference| of the two main branches
DECAY_GRID = (0.3, 0.45, 0.6, 0.8, 1.0)


class _Hint:
    tokens: Sequence[int] = ()


class _PreferTrie(PySuffixTrie):
    def __init__(self, max_depth: int, hint: _Hint) -> None:
        super().__init__(max_depth)
        self.hint = hint

    def draft(self, *args):
        return super().draft(*args, prefer=self.hint.tokens)


class _PreferStore(DraftStore):
    """A python-backend store whose tries rank the hinted continuation first."""

    def __init__(self, config: StoreConfig, hint: _Hint) -> None:
        self.hint = hint
        super().__init__(config, backend="python")

    def _new_trie(self, depth: Optional[int] = None):
        return _PreferTrie(depth or self.config.max_depth, self.hint)


class RankOracleSource(RhymeSource):
    def __init__(self, name: str = "rhyme-rankoracle", config: Optional[StoreConfig] = None) -> None:
        self.name = name
        self.hint = _Hint()
        self.store = _PreferStore(config or StoreConfig(), self.hint)

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        self.hint.tokens = rec.response_token_ids[len(context):len(context) + k]
        try:
            return self.store.speculate(request_id(rec), k)
        finally:
            self.hint.tokens = ()


class BranchAnalysis(RankOracleSource):
    """Drives the replay with the plain store's drafts; collects branch-point statistics."""

    def __init__(self, config: Optional[StoreConfig] = None) -> None:
        super().__init__("rhyme-branches", config)
        self.epoch = 1
        self.steps = self.lost = self.steps_lost = self.steps_with_branch = 0
        self.points: List[dict] = []
        self._index: Dict[str, tuple] = {}

    # replay interface -----------------------------------------------------------------
    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        ref = rec.response_token_ids[len(context):]
        oracle = super().propose(rec, context, k)
        draft = self.store.speculate(request_id(rec), k)   # last: the window sees this draft
        a, a_oracle = accepted_length(draft, ref), accepted_length(oracle, ref)
        self.steps += 1
        self.lost += max(0, a_oracle - a)
        self.steps_lost += a_oracle > a
        if self._walk(rec, ref, k, a, a_oracle):
            self.steps_with_branch += 1
        return draft

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        super().end_epoch(epoch, records, kept)
        self.epoch = epoch + 1

    # analysis -------------------------------------------------------------------------
    def _history(self, key: str):
        """(index, features) of the prompt's stored records, rebuilt when they change."""
        ph = self.store._prompts.get(key)
        if ph is None or not ph.records:
            return None
        stamp = (self.epoch, ph.num_records())
        cached = self._index.get(key)
        if cached is None or cached[0] != stamp:
            cfg = self.store.config
            old, feats = history_features(ph.records, self.epoch + 1, 1.0, math.inf)
            ages = np.array([self.epoch - r.epoch for r in old], dtype=float)
            cached = (stamp, HistoryIndex([r.seq for r in old]), feats[:, 1], ages,
                      min(cfg.max_pattern, cfg.max_depth - 1))
            self._index[key] = cached
        return cached[1:]

    def _walk(self, rec: TraceRecord, ref: Sequence[int], k: int, a: int, a_oracle: int) -> bool:
        hist = self._history(rec.prompt_id)
        if hist is None:
            return False
        index, adv, ages, max_match = hist
        seq = self.store._requests[request_id(rec)].seq
        m, occ = index.match(seq, len(seq), max_match)
        found = False
        for d in range(min(k, len(ref), self.store.config.max_depth - 1 - m)):
            if not occ:
                break
            br = index.branches(occ)
            if len(br) > 1:
                found = True
                self.points.append(_point(br, ref[d], adv, ages, d, a, a_oracle, self.epoch))
            if ref[d] not in br:
                break
            occ = index.extend(occ, ref[d])
        return found

    def report(self, tau: float, tau_oracle: Optional[float]) -> dict:
        return summarize(self.points, self.steps, self.steps_with_branch, self.lost,
                         self.steps_lost, tau, tau_oracle)


def _point(br: Dict[int, List[int]], taken: int, adv: np.ndarray, ages: np.ndarray, depth: int,
           a: int, a_oracle: int, epoch: int) -> dict:
    tokens = list(br)
    rows = [np.asarray(br[t]) for t in tokens]
    return {"depth": depth, "epoch": epoch, "taken": tokens.index(taken) if taken in br else None,
            "adv": [adv[r] for r in rows], "age": [ages[r] for r in rows],
            "draft_right": a > depth, "oracle_right": a_oracle > depth}


def _share(p: dict, coef: float, decay: float, clip: float = 2.0) -> np.ndarray:
    s = np.array([np.sum(decay ** ag * np.exp(coef * np.clip(ad, -clip, clip)))
                  for ad, ag in zip(p["adv"], p["age"])])
    return s / s.sum()


def _bin(x: float, edges: Sequence[float]) -> str:
    if x == 0:
        return "0"
    lo = 0.0
    for hi in edges[1:]:
        if x <= hi:
            return f"({lo:g},{hi:g}]"
        lo = hi
    return f">{lo:g}"


def summarize(points: List[dict], steps: int, steps_with_branch: int, lost: int, steps_lost: int,
              tau: float, tau_oracle: Optional[float]) -> dict:
    """Aggregate branch points: follow rates by advantage difference and by age, the likelihood of
    the reference's choices per reward coefficient and recency decay, and tokens lost."""
    taken = [p for p in points if p["taken"] is not None]
    out = {"steps": steps, "steps_with_branch_point": steps_with_branch,
           "branch_points": len(points), "reference_takes_a_branch": len(taken),
           "tokens_lost_by_ranking": lost, "steps_losing_tokens": steps_lost,
           "tau": tau, "tau_rank_oracle": tau_oracle,
           "draft_took_reference_branch": sum(p["draft_right"] for p in taken) / max(1, len(taken))}
    by_adv, by_age = defaultdict(lambda: [0, 0, 0, 0.0, 0.0]), defaultdict(lambda: [0, 0, 0, 0.0])
    for p in taken:
        # the two main branches by recency-weighted support (what drafting without reward ranks)
        base = _share(p, 0.0, 0.6)
        i, j = np.argsort(-base, kind="stable")[:2]
        hi, lo = (i, j) if np.mean(p["adv"][i]) >= np.mean(p["adv"][j]) else (j, i)
        cell = by_adv[_bin(float(np.mean(p["adv"][hi]) - np.mean(p["adv"][lo])), ADV_BINS)]
        cell[0] += 1
        cell[1] += p["taken"] == hi
        cell[2] += p["taken"] == lo
        cell[3] += base[hi] / (base[hi] + base[lo])
        cur = _share(p, 0.5, 0.6)
        cell[4] += cur[hi] / (cur[hi] + cur[lo])
        new, old = (i, j) if min(p["age"][i]) <= min(p["age"][j]) else (j, i)
        gap = int(min(p["age"][old]) - min(p["age"][new]))
        age_cell = by_age[min(gap, 3)]
        age_cell[0] += 1
        age_cell[1] += p["taken"] == new
        age_cell[2] += p["taken"] == old
        age_cell[3] += _share(p, 0.0, 1.0)[new] / (_share(p, 0.0, 1.0)[[new, old]].sum())
    out["by_advantage_difference"] = {
        b: {"n": c[0], "follows_higher_adv": c[1] / c[0], "follows_lower_adv": c[2] / c[0],
            "share_higher_noreward": c[3] / c[0], "share_higher_current": c[4] / c[0]}
        for b, c in sorted(by_adv.items(), key=lambda kv: _bin_order(kv[0]))}
    out["by_age_gap"] = {
        (f"{g}+" if g == 3 else str(g)): {"n": c[0], "follows_newer": c[1] / c[0],
                                          "follows_older": c[2] / c[0], "count_share_newer": c[3] / c[0]}
        for g, c in sorted(by_age.items())}
    out["fit"] = _fit(taken)
    out["fit_by_epoch"] = {}
    for e in sorted({p["epoch"] for p in taken}):
        fit = _fit([p for p in taken if p["epoch"] == e], decays=(0.6,))
        out["fit_by_epoch"][str(e)] = {"points": sum(p["epoch"] == e for p in taken),
                                       "best_coef": fit["best_coef"], **fit["grid"]["0.6"]}
    return out


def _bin_order(name: str) -> float:
    return -1.0 if name == "0" else float(name.strip("(>").split(",")[0])


def _fit(taken: List[dict], decays: Sequence[float] = DECAY_GRID) -> dict:
    """Log-likelihood and top-1 accuracy of the reference's branch choices on a grid of reward
    coefficients and recency decays (the store's model: P(b) ~ sum decay^age exp(coef clip(adv)))."""
    coefs = np.asarray(COEF_GRID)
    table = {}
    for decay in decays:
        ll, top1 = np.zeros(len(coefs)), np.zeros(len(coefs))
        for p in taken:
            branches = [np.stack([ag * math.log(decay), np.clip(ad, -2, 2)], axis=1)
                        for ad, ag in zip(p["adv"], p["age"])]
            ll += branch_loglik(branches, p["taken"], coefs)
            for c, coef in enumerate(coefs):
                share = _share(p, coef, decay)
                top1[c] += int(np.argmax(share)) == p["taken"]
        n = max(1, len(taken))
        table[f"{decay:g}"] = {f"{c:g}": {"loglik_per_point": float(v / n), "top1": float(t / n)}
                               for c, v, t in zip(coefs, ll, top1)}
    best = max(((d, c) for d in table for c in table[d]),
               key=lambda dc: table[dc[0]][dc[1]]["loglik_per_point"])
    return {"grid": table, "best_decay": float(best[0]), "best_coef": float(best[1])}


def format_report(rep: dict) -> str:
    lines = [f"branch points: {rep['branch_points']} in {rep['steps_with_branch_point']} of "
             f"{rep['steps']} verify steps; the reference takes one of the branches at "
             f"{rep['reference_takes_a_branch']}, the draft accepted it at "
             f"{100 * rep['draft_took_reference_branch']:.0f}% of those",
             f"tokens lost by ranking (oracle minus draft, same positions): "
             f"{rep['tokens_lost_by_ranking']} in {rep['steps_losing_tokens']} steps"]
    if rep["tau_rank_oracle"] is not None:
        lines.append(f"rank-oracle tau {rep['tau_rank_oracle']:.3f} vs rhyme {rep['tau']:.3f} "
                     f"(ceiling gain {rep['tau_rank_oracle'] - rep['tau']:+.3f})")
    lines.append(f"{'|adv diff|':<10} {'n':>5} {'->hi':>6} {'->lo':>6} {'share hi w=0':>13} "
                 f"{'share hi w=.5':>14}")
    for b, c in rep["by_advantage_difference"].items():
        lines.append(f"{b:<10} {c['n']:>5} {c['follows_higher_adv']:>6.2f} "
                     f"{c['follows_lower_adv']:>6.2f} {c['share_higher_noreward']:>13.2f} "
                     f"{c['share_higher_current']:>14.2f}")
    lines.append(f"{'age gap':<10} {'n':>5} {'->new':>6} {'->old':>6} {'count share new':>16}")
    for g, c in rep["by_age_gap"].items():
        lines.append(f"{g:<10} {c['n']:>5} {c['follows_newer']:>6.2f} {c['follows_older']:>6.2f} "
                     f"{c['count_share_newer']:>16.2f}")
    fit = rep["fit"]
    row = fit["grid"]["0.6"]
    lines.append("decay 0.6, coef: " + "  ".join(
        f"{c}: ll {v['loglik_per_point']:.3f} top1 {v['top1']:.3f}" for c, v in row.items()))
    lines.append(f"max-likelihood decay {fit['best_decay']:g}, coef {fit['best_coef']:g}")
    lines.append("max-likelihood coef per epoch (decay 0.6): " + ", ".join(
        f"e{e}: {f['best_coef']:g} ({f['points']} points)" for e, f in rep["fit_by_epoch"].items()))
    return "\n".join(lines)
