"""The ceiling for any copy-from-history chain drafter.

Definition: at position p of response R (context = prompt + R[:p], last context token x), the
oracle drafts R[p:p+a] for the largest a <= k such that the token string (x, R[p], ..., R[p+a-1])
occurs contiguously in some allowed sequence, an allowed sequence being an allowed history
response prefixed with the last token of its prompt (so response starts can be copied too).
Allowed = every prompt's responses of earlier epochs; in online mode also the same prompt's
finished responses of the current epoch with a smaller sample index. One context token is the
least any copy-from-history drafter must match, so no such chain drafter can accept more.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord

from .base import DraftSource, chain


class OracleSource(DraftSource):
    name = "oracle"

    def __init__(self, k: int) -> None:
        self.k = k
        self.grams: Set[Tuple[int, ...]] = set()
        self.siblings: Dict[str, Set[Tuple[int, ...]]] = {}

    def _add(self, target: Set[Tuple[int, ...]], rec: TraceRecord) -> None:
        seq = rec.prompt_token_ids[-1:] + rec.response_token_ids
        for i in range(len(seq) - 1):
            for n in range(2, min(self.k + 1, len(seq) - i) + 1):
                target.add(tuple(seq[i:i + n]))

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        p = len(context)
        last = context[-1] if p else rec.prompt_token_ids[-1]
        ref = rec.response_token_ids
        sib = self.siblings.get(rec.prompt_id, set())
        a = 0
        while a < min(k, len(ref) - p):
            gram = (last,) + tuple(ref[p:p + a + 1])
            if gram not in self.grams and gram not in sib:
                break
            a += 1
        return chain(ref[p:p + a])

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        if keep:
            self._add(self.siblings.setdefault(rec.prompt_id, set()), rec)

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        for rec in records:
            self._add(self.grams, rec)
        self.siblings = {}
