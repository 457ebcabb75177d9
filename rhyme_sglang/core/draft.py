"""The engine-independent draft record and helpers to score it against a reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence


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

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

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
