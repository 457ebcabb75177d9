"""The interface every replayed draft source implements."""

from __future__ import annotations

from typing import List, Sequence

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord


class DraftSource:
    """One draft source under replay.

    Call order per epoch e >= 1, for each response R (prompt order, then sample order):
    `start(R)`, then per verify step `propose(R, context, k)` -> Draft, `feedback(R, proposed,
    accepted)`, `advance(R, new_tokens)`, and finally `finish(R, keep)`; `keep` is True in online
    mode (R becomes visible to later siblings of the same prompt). After the epoch,
    `end_epoch(e, records, kept)`: the epoch's responses become history (unless already kept).
    Epoch 0 is only passed to `end_epoch`.
    """

    name = "base"

    def start(self, rec: TraceRecord) -> None:
        pass

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        raise NotImplementedError

    def feedback(self, rec: TraceRecord, proposed: int, accepted: int) -> None:
        pass

    def advance(self, rec: TraceRecord, tokens: Sequence[int]) -> None:
        pass

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        pass

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        pass


def request_id(rec: TraceRecord) -> str:
    return f"{rec.prompt_id}/{rec.epoch}/{rec.sample}"


def chain(tokens: Sequence[int]) -> Draft:
    toks = [int(t) for t in tokens]
    return Draft(toks, list(range(-1, len(toks) - 1)), [1.0] * len(toks), float(len(toks)), 0)
