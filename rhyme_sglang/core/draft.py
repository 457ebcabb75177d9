"""The engine-independent draft record and helpers to score it against a reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence


@dataclass
class Draft:
    """A draft chain or tree.

    `token_ids[i]` hangs under `parents[i]` (-1 = directly after the context); parents always come
    before their children. `probs[i]` is the estimated probability of the whole root path ending at
    node i (the product of conditional child-weight ratios). `score` is the sum of `probs`
    (the expected number of accepted draft tokens under the store's estimate). `match_len` is the
    number of context tokens matched in the tree the draft came from; `source` names that tree.
    """

    token_ids: List[int] = field(default_factory=list)
    parents: List[int] = field(default_factory=list)
    probs: List[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""
    _order: Optional[List[int]] = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    def paths(self) -> List[List[int]]:
        """All root-to-leaf token paths."""
        has_child = [False] * len(self.token_ids)
        for p in self.parents:
            if p >= 0:
                has_child[p] = True
        out = []
        for i, leaf in enumerate(has_child):
            if not leaf:
                path, j = [], i
                while j >= 0:
                    path.append(self.token_ids[j])
                    j = self.parents[j]
                out.append(path[::-1])
        return out

    def check_integrity(self) -> bool:
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.probs) != n:
            return False
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                return False
        seen = set()
        for i, p in enumerate(self.parents):
            key = (p, self.token_ids[i])
            if key in seen:
                return False
            seen.add(key)
        return True


def accepted_length(draft: Draft, reference: Sequence[int]) -> int:
    """Length of the longest root path of `draft` equal to a prefix of `reference`."""
    children = {}
    for i, (p, t) in enumerate(zip(draft.parents, draft.token_ids)):
        children.setdefault(p, {})[t] = i
    node, a = -1, 0
    while a < len(reference):
        nxt = children.get(node, {}).get(reference[a])
        if nxt is None:
            break
        node, a = nxt, a + 1
    return a


def best_first_order(draft: Draft) -> List[int]:
    """Node indices in the order a best-first expansion takes them: starting from the root's
    children, repeatedly the most probable node whose parent is already taken (ties: the
    earlier node). Path probabilities never grow along a path, so the first ``w`` of them
    are the ``w`` most probable nodes, and every prefix is ancestor-closed. Computed once
    per draft (the width choice and the truncation of one step both read it)."""
    if draft._order is not None and len(draft._order) == len(draft.token_ids):
        return draft._order
    children: dict = {}
    for i, p in enumerate(draft.parents):
        children.setdefault(p, []).append(i)
    frontier = list(children.get(-1, ()))
    order: List[int] = []
    while frontier:
        best = min(frontier, key=lambda i: (-draft.probs[i], i))
        frontier.remove(best)
        order.append(best)
        frontier.extend(children.get(best, ()))
    draft._order = order
    return order


def expected_accepts(draft: Draft, widths: Sequence[int]) -> dict:
    """``{w: expected accepted draft tokens when verifying the w most probable nodes}``.

    Node i is accepted with (estimated) probability ``probs[i]``, the product of the
    conditional probabilities along its root path, so the expectation of a node set is
    the sum of its path probabilities."""
    prefix = [0.0]
    for i in best_first_order(draft):
        prefix.append(prefix[-1] + draft.probs[i])
    out = {}
    for w in widths:
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"draft widths must be ints >= 0, got {w!r}")
        out[w] = prefix[min(w, len(prefix) - 1)]
    return out


def truncate(draft: Draft, width: int) -> Draft:
    """The draft restricted to its ``width`` most probable nodes (ancestor-closed, draft order)."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    if width >= len(draft.token_ids):
        return draft
    keep = sorted(best_first_order(draft)[:width])
    new_index = {old: new for new, old in enumerate(keep)}
    probs = [draft.probs[i] for i in keep]
    return Draft(
        token_ids=[draft.token_ids[i] for i in keep],
        parents=[new_index[draft.parents[i]] if draft.parents[i] >= 0 else -1 for i in keep],
        probs=probs, score=sum(probs), match_len=draft.match_len, source=draft.source,
    )
