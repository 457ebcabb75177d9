"""The published RhymeRL recipe's drafting policy, re-implemented in plain Python as a baseline.

One suffix trie per prompt over the latest epoch's group responses, each prefixed with the last 5
prompt tokens; pattern = last 7 context tokens, tried from 7 down to 4; a chain along the
highest-count child, stopping when the product of count ratios (child / parent) drops below 0.1;
a per-request window starting at 2, doubled (max 16) on full acceptance, halved (min 2) otherwise.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord

from .base import DraftSource, chain, request_id

PREFIX, MAX_PAT, MIN_PAT, MIN_PROD = 5, 7, 4, 0.1
WIN_START, WIN_MIN, WIN_MAX, DEPTH = 2, 2, 16, 7 + 16


class _Trie:
    def __init__(self) -> None:
        self.root: dict = {}  # node = [count, children]

    def add(self, seq: Sequence[int]) -> None:
        for i in range(len(seq)):
            node = self.root
            for t in seq[i:i + DEPTH]:
                child = node.get(t)
                if child is None:
                    child = node[t] = [0, {}]
                child[0] += 1
                node = child[1]

    def find(self, pattern: Sequence[int]):
        node, count = self.root, 0
        for t in pattern:
            child = node.get(t)
            if child is None:
                return None
            count, node = child
        return count, node


class HistoSpecSource(DraftSource):
    name = "histospec"

    def __init__(self) -> None:
        self.trees: Dict[str, _Trie] = {}
        self.windows: Dict[str, int] = {}

    @staticmethod
    def _seq(rec: TraceRecord) -> List[int]:
        return rec.prompt_token_ids[-PREFIX:] + rec.response_token_ids

    def start(self, rec: TraceRecord) -> None:
        self.windows[request_id(rec)] = WIN_START

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        tree = self.trees.get(rec.prompt_id)
        if tree is None:
            return Draft()
        ctx = (rec.prompt_token_ids[-PREFIX:] + list(context))[-MAX_PAT:]
        budget = min(k, self.windows[request_id(rec)])
        for m in range(min(MAX_PAT, len(ctx)), MIN_PAT - 1, -1):
            found = tree.find(ctx[len(ctx) - m:])
            if found is None or not found[1]:
                continue
            count, node = found
            out, prod = [], 1.0
            while node and len(out) < budget:
                tok, (c, children) = max(node.items(), key=lambda kv: (kv[1][0], -kv[0]))
                prod *= c / count
                if prod < MIN_PROD:
                    break
                out.append(tok)
                count, node = c, children
            return chain(out)
        return Draft()

    def feedback(self, rec: TraceRecord, proposed: int, accepted: int) -> None:
        rid = request_id(rec)
        if proposed == 0:
            return
        w = self.windows[rid]
        self.windows[rid] = min(WIN_MAX, w * 2) if accepted == proposed else max(WIN_MIN, w // 2)

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        self.windows.pop(request_id(rec), None)
        if keep:
            self.trees.setdefault(rec.prompt_id, _Trie()).add(self._seq(rec))

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        self.trees = {}
        for rec in records:
            self.trees.setdefault(rec.prompt_id, _Trie()).add(self._seq(rec))
