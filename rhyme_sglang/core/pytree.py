"""Pure-Python bounded-depth weighted suffix trie: the reference twin of the native module.

Every stored sequence contributes each of its substrings of length <= `max_depth` once per
occurrence: the node spelling string s has `count` = number of occurrences of s and `weight` =
sum of the integer weights of the sequences those occurrences belong to. Integer weights make
sums exact and independent of insertion order, so two tries holding the same multiset of
sequences (native or Python, before or after a snapshot) produce identical drafts.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Sequence, Tuple

DraftTuple = Tuple[List[int], List[int], List[float], float, int]
NODE_BYTES = 120  # rough per-node cost of a Python node (object + dict entry in the parent)


class _Node:
    __slots__ = ("children", "count", "weight")

    def __init__(self) -> None:
        self.children: dict = {}
        self.count = 0
        self.weight = 0


def _check_weight(weight: int) -> None:
    if weight <= 0:
        raise ValueError(f"weight must be > 0, got {weight}")


def _top_children(node: _Node, max_branch: int, prefer: int = -1):
    """(token, child, weight) of the `max_branch` heaviest children (weight desc, token asc).
    With `prefer` a child's token, that child trades weights with the heaviest child first."""
    items = [(tok, c, c.weight) for tok, c in node.children.items()]
    if prefer in node.children:
        top = min(items, key=lambda it: (-it[2], it[0]))
        pref = node.children[prefer]
        swap = {top[0]: pref.weight, prefer: top[2]}
        items = [(tok, c, swap.get(tok, w)) for tok, c, w in items]
    if len(items) <= max_branch:
        return sorted(items, key=lambda it: (-it[2], it[0]))
    return heapq.nsmallest(max_branch, items, key=lambda it: (-it[2], it[0]))


class PySuffixTrie:
    """Weighted suffix trie of bounded depth over a multiset of token sequences."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node()
        self._num_nodes = 0
        self._streams: Dict[int, int] = {}  # open stream handle -> tokens it holds
        self._next_stream = 0

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def clear(self) -> None:
        self._root = _Node()
        self._num_nodes = 0
        self._streams.clear()

    # ---- changing the stored multiset: insert, extend, reweight, remove
    def insert(self, seq: Sequence[int], weight: int) -> None:
        """Store one more occurrence of `seq` with `weight` (> 0): each substring of length
        <= max_depth gains count 1 and `weight`."""
        _check_weight(weight)
        self._add(seq, 0, weight)

    def extend(self, seq: Sequence[int], lo: int, weight: int, stream: int = -1) -> None:
        """`seq[:lo]` is stored with `weight`; store the rest (the substrings ending at `lo` or
        later). `stream`: a handle from `open_stream` holding `seq[:lo]`; it changes only how
        compactly the native trie stores the growth, never the content."""
        _check_weight(weight)
        if not 0 <= lo <= len(seq):
            raise ValueError(f"lo must be in [0, len(seq)], got {lo}")
        if stream != -1:
            held = self._open(stream)
            if held != lo:
                raise ValueError(f"stream {stream} holds {held} tokens, not seq[:lo] with lo={lo}")
            self._streams[stream] = len(seq)
        self._add(seq, lo, weight)

    def open_stream(self, seq: Sequence[int], weight: int) -> int:
        """Insert `seq` as a sequence that will grow through `extend(..., stream=handle)`;
        returns the handle, which the caller gives back with `close_stream`."""
        _check_weight(weight)
        handle, self._next_stream = self._next_stream, self._next_stream + 1
        self._streams[handle] = len(seq)
        self._add(seq, 0, weight)
        return handle

    def close_stream(self, stream: int) -> None:
        """The sequence of `stream` stops growing (it stays stored); the handle becomes invalid."""
        self._open(stream)
        del self._streams[stream]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def reweight(self, seq: Sequence[int], dweight: int) -> None:
        """Add `dweight` to the weight of a stored occurrence of `seq`."""
        for node in self._walk_stored(seq):
            node.weight += dweight

    def remove(self, seq: Sequence[int], weight: int) -> None:
        """Remove a stored occurrence of `seq` with `weight`; nodes left with count 0 are
        deleted with their subtrees."""
        _check_weight(weight)
        for node, parent, tok in self._walk_stored(seq, with_parent=True):
            node.count -= 1
            node.weight -= weight
            if node.count == 0:
                if node.weight != 0:
                    raise ValueError("removal does not match a stored sequence")
                del parent.children[tok]
                self._num_nodes -= self._subtree_size(node)

    def _open(self, stream: int) -> int:
        held = self._streams.get(stream)
        if held is None:
            raise ValueError(f"no open stream {stream!r}")
        return held

    def _add(self, seq: Sequence[int], lo: int, weight: int) -> None:
        n, depth = len(seq), self.max_depth
        for i in range(max(0, lo - depth + 1), n):
            node = self._root
            for j in range(i, min(n, i + depth)):
                tok = seq[j]
                child = node.children.get(tok)
                if child is None:
                    if j < lo:
                        raise ValueError(f"sequence is not stored: missing token {tok} at offset {j}")
                    child = node.children[tok] = _Node()
                    self._num_nodes += 1
                if j >= lo:
                    child.count += 1
                    child.weight += weight
                node = child

    def _walk_stored(self, seq: Sequence[int], with_parent: bool = False):
        """The node of every substring seq[i:j+1] (j - i < max_depth), suffix by suffix from the
        root; a node whose count the caller drops to 0 ends its suffix's walk. ValueError when
        `seq` is not stored."""
        n, depth = len(seq), self.max_depth
        for i in range(n):
            node = self._root
            for j in range(i, min(n, i + depth)):
                child = node.children.get(seq[j])
                if child is None:
                    raise ValueError(f"sequence is not stored: missing token {seq[j]} at offset {j}")
                yield (child, node, seq[j]) if with_parent else child
                if child.count == 0:
                    break
                node = child

    @staticmethod
    def _subtree_size(node: _Node) -> int:
        size, stack = 0, [node]
        while stack:
            cur = stack.pop()
            size += 1
            stack.extend(cur.children.values())
        return size

    def lookup(self, path: Sequence[int]) -> Tuple[int, int]:
        """(count, weight) of the node spelling `path`; (0, 0) when absent."""
        node = self._root
        for tok in path:
            node = node.children.get(tok)
            if node is None:
                return 0, 0
        return node.count, node.weight

    def draft(self, context: Sequence[int], max_pattern: int, budget: int, min_prob: float,
              max_branch: int, prior: float = 0.0, prior_decay: float = 1.0,
              prefer: Sequence[int] = ()) -> DraftTuple:
        """Best-first draft after the longest suffix of `context` (<= max_pattern) with children.

        Returns (token_ids, parents, path_probs, score, match_len); empty when nothing matches.
        Children are ranked by (weight desc, token asc); the conditional probability of a child is
        its weight over the sum of its siblings' weights, times C / (C + prior * prior_decay**L)
        where C is the number of occurrences continuing past the parent (few occurrences = less
        certain) and L the number of tokens the parent spells (matched context + draft path: one
        occurrence after a long context is stronger evidence); nodes are taken in order of path
        probability (ties: first pushed first) while it is >= min_prob, up to `budget` nodes.
        `prefer` (hindsight, for the replay's branch-ranking oracle only; the native trie has no
        such argument): along the path that spells `prefer` from the matched node, the child it
        continues with trades weights with the heaviest sibling, so it ranks first.
        """
        best, match_len = None, 0
        ctx_len = len(context)
        for m in range(1, min(max_pattern, ctx_len, self.max_depth - 1) + 1):
            node = self._root
            for tok in context[ctx_len - m:]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is None:
                break
            if node.children:
                best, match_len = node, m
        tokens: List[int] = []
        parents: List[int] = []
        probs: List[float] = []
        if best is None or budget <= 0:
            return tokens, parents, probs, 0.0, 0
        heap: list = []
        seq_no = 0

        def push(node: _Node, parent_idx: int, base: float, length: int, on: int) -> None:
            nonlocal seq_no
            total = sum(c.weight for c in node.children.values())
            support = sum(c.count for c in node.children.values())
            eff_prior = prior * prior_decay ** float(length)
            conf = float(support) / (float(support) + eff_prior)
            want = prefer[on] if 0 <= on < len(prefer) else -1
            for tok, child, weight in _top_children(node, max_branch, want):
                cond = float(weight) / float(total) * conf
                nxt = on + 1 if tok == want else -1
                heapq.heappush(heap, (-(base * cond), seq_no, tok, parent_idx, child, length + 1, nxt))
                seq_no += 1

        push(best, -1, 1.0, match_len, 0)
        score = 0.0
        while heap and len(tokens) < budget:
            neg, _, tok, parent_idx, node, length, on = heapq.heappop(heap)
            prob = -neg
            if prob < min_prob:
                break
            tokens.append(tok)
            parents.append(parent_idx)
            probs.append(prob)
            score += prob
            if node.children:
                push(node, len(tokens) - 1, prob, length, on)
        return tokens, parents, probs, score, match_len

    def estimate_memory(self) -> int:
        return 64 + self._num_nodes * NODE_BYTES

    def check_integrity(self) -> bool:
        """Counts/weights positive, each node >= the sum of its children, depth bounded."""
        num = 0
        stack = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            if depth > self.max_depth:
                return False
            csum = wsum = 0
            for child in node.children.values():
                num += 1
                if child.count <= 0 or child.weight <= 0:
                    return False
                csum += child.count
                wsum += child.weight
                stack.append((child, depth + 1))
            if node is not self._root and (csum > node.count or wsum > node.weight):
                return False
        return num == self._num_nodes
