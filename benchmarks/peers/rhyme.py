"""Our DraftStore behind the replay interface."""

from __future__ import annotations

from typing import List, Sequence

from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord

from .base import DraftSource, request_id


class RhymeSource(DraftSource):
    def __init__(self, name: str = "rhyme", config: StoreConfig = None, backend: str = "auto"):
        self.name = name
        self.store = DraftStore(config or StoreConfig(), backend=backend)

    def start(self, rec: TraceRecord) -> None:
        self.store.start_request(request_id(rec), rec.prompt_token_ids, rec.prompt_id, rec.sample)

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        return self.store.speculate(request_id(rec), k)

    def feedback(self, rec: TraceRecord, proposed: int, accepted: int) -> None:
        self.store.record_acceptance(request_id(rec), proposed, accepted)

    def advance(self, rec: TraceRecord, tokens: Sequence[int]) -> None:
        self.store.add_tokens(request_id(rec), tokens)

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        self.store.finish_request(request_id(rec), rec.reward, add_to_history=keep)

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        if not kept:
            for r in records:
                self.store.add_response(r.prompt_id, r.prompt_token_ids, r.response_token_ids,
                                        r.epoch, r.reward, r.sample)
        while self.store.epoch <= epoch:
            self.store.advance_epoch()
