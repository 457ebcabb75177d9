"""Combining drafts from several tries into one tree by mixing their path probabilities."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .draft import Draft

Path = Tuple[int, ...]


def path_probs(tokens: Sequence[int], parents: Sequence[int], probs: Sequence[float]) -> Dict[Path, float]:
    """Map each node's root path (as a token tuple) to its path probability."""
    paths: List[Path] = []
    out: Dict[Path, float] = {}
    for tok, par, pr in zip(tokens, parents, probs):
        path = (paths[par] if par >= 0 else ()) + (tok,)
        paths.append(path)
        out[path] = pr
    return out


def mix_drafts(parts: Sequence[Tuple[float, Dict[Path, float]]], budget: int, min_prob: float,
               match_len: int, source: str) -> Draft:
    """Tree of the `budget` paths with the highest mixed probability sum_i w_i * P_i(path).

    Each P_i is non-increasing along a path, so the mixture is too, and taking nodes in order of
    (probability desc, depth asc, tokens asc) always takes a parent before its children."""
    mixed: Dict[Path, float] = {}
    for w, probs in parts:
        for path, p in probs.items():
            mixed[path] = mixed.get(path, 0.0) + w * p
    order = sorted(mixed.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    index: Dict[Path, int] = {}
    draft = Draft(match_len=match_len, source=source)
    for path, p in order:
        if len(draft.token_ids) >= budget or p < min_prob:
            break
        parent = index.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and path[:-1] not in index:
            continue
        index[path] = len(draft.token_ids)
        draft.token_ids.append(path[-1])
        draft.parents.append(parent)
        draft.probs.append(p)
        draft.score += p
    return draft


def mix_draft_py(tries: Sequence[Optional[object]], weights: Sequence[float], context: Sequence[int],
                 max_pattern: int, budget: int, min_prob: float, max_branch: int, prior: float,
                 prior_decay: float = 1.0):
    """Pure-Python twin of the native `mix_draft`: every trie (None = skipped) drafts 2*budget
    nodes without a probability floor; their path probabilities are mixed with weights normalised
    over the tries that matched. Returns (tokens, parents, probs, score, match_len, used_mask)."""
    if len(tries) != len(weights):
        raise ValueError(f"{len(tries)} tries but {len(weights)} weights")
    parts, match_len, used = [], 0, 0
    for i, (trie, w) in enumerate(zip(tries, weights)):
        if trie is None or w <= 0:
            continue
        toks, parents, probs, _, m = trie.draft(context, max_pattern, 2 * budget, 0.0, max_branch, prior,
                                           prior_decay)
        if toks:
            parts.append((w, path_probs(toks, parents, probs)))
            match_len, used = max(match_len, m), used | (1 << i)
    if not parts:
        return [], [], [], 0.0, 0, 0
    total = 0.0
    for w, _ in parts:
        total += w
    d = mix_drafts([(w / total, p) for w, p in parts], budget, min_prob, match_len, "")
    return d.token_ids, d.parents, d.probs, d.score, match_len, used
