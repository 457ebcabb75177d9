"""Ceilings for copy-from-history chain drafters (hindsight: they read the reference).

`oracle`: at position p of response R (context = prompt + R[:p], last context token x), draft
R[p:p+a] for the largest a <= k such that the token string (x, R[p], ..., R[p+a-1]) occurs
contiguously in some allowed sequence, an allowed sequence being an allowed history response
prefixed with the last token of its prompt (so response starts can be copied too). Allowed =
every prompt's responses of earlier epochs; in online mode also the same prompt's finished
responses of the current epoch with a smaller sample index.

`oracle-ext` also allows the request's own context (its whole prompt and R[:p]): every source
the rhyme store drafts from (history, prompt text, the request's own tokens), so it bounds rhyme
as well as the history-only peers.

Why no chain drafter drawing on the same sequences can do better: one context token is the
least such a drafter must match, and because the allowed strings are closed under taking
substrings, a(p + 1) >= a(p) - 1, so taking the longest chain at every step is the optimal
policy. A tree drafter's accepted path is one chain, so the bound holds for trees too.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord

from .base import DraftSource, chain

Gram = Tuple[int, ...]


class OracleSource(DraftSource):
    def __init__(self, k: int, extended: bool = False) -> None:
        self.k = k
        self.extended = extended
        self.name = "oracle-ext" if extended else "oracle"
        self.grams: Set[Gram] = set()
        self.siblings: Dict[str, Set[Gram]] = {}
        self.own: Set[Gram] = set()
        self.own_seq: List[int] = []

    def _add_from(self, target: Set[Gram], seq: Sequence[int], start: int) -> None:
        """Add every gram of 2..k+1 tokens of `seq` that ends at index >= start + 1."""
        for end in range(max(start + 1, 1), len(seq)):
            for n in range(2, min(self.k + 1, end + 1) + 1):
                target.add(tuple(seq[end - n + 1:end + 1]))

    def start(self, rec: TraceRecord) -> None:
        self.own, self.own_seq = set(), []
        if self.extended:
            self.own_seq = list(rec.prompt_token_ids)
            self._add_from(self.own, self.own_seq, 0)

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        p = len(context)
        last = context[-1] if p else rec.prompt_token_ids[-1]
        ref = rec.response_token_ids
        sib = self.siblings.get(rec.prompt_id, set())
        a = 0
        while a < min(k, len(ref) - p):
            gram = (last,) + tuple(ref[p:p + a + 1])
            if gram not in self.grams and gram not in sib and gram not in self.own:
                break
            a += 1
        return chain(ref[p:p + a])

    def advance(self, rec: TraceRecord, tokens: Sequence[int]) -> None:
        if self.extended:
            old = len(self.own_seq)
            self.own_seq.extend(tokens)
            self._add_from(self.own, self.own_seq, old - 1)

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        if keep:
            self._add_record(self.siblings.setdefault(rec.prompt_id, set()), rec)

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        for rec in records:
            self._add_record(self.grams, rec)
        self.siblings = {}

    def _add_record(self, target: Set[Gram], rec: TraceRecord) -> None:
        self._add_from(target, rec.prompt_token_ids[-1:] + rec.response_token_ids, 0)
