"""ArcticInference's SuffixDecodingCache (global tree over past responses) as a baseline.

Imported from the cache dir built by scripts/build_arctic_suffix.sh (default .cache/arctic).
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord

from .base import DraftSource, request_id

CACHE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", ".cache", "arctic")
CONTEXT = 64


def import_error(cache_dir: str = CACHE_DIR) -> Optional[str]:
    path = os.path.abspath(cache_dir)
    if not os.path.isdir(os.path.join(path, "arctic_inference")):
        return f"not built: run scripts/build_arctic_suffix.sh (looked in {path})"
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class ArcticSource(DraftSource):
    def __init__(self, tree: bool = False) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.name = "suffix-tree" if tree else "suffix"
        self.tree = tree
        self.cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=-1)
        self._n = 0

    def start(self, rec: TraceRecord) -> None:
        self.cache.start_request(request_id(rec), rec.prompt_token_ids)

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        full = (rec.prompt_token_ids + list(context))[-CONTEXT:]
        d = self.cache.speculate(request_id(rec), full, max_spec_tokens=k, max_spec_factor=1.0,
                                 min_token_prob=0.1, use_tree_spec=self.tree)
        return Draft(list(d.token_ids), list(d.parents), list(d.probs), d.score, d.match_len)

    def advance(self, rec: TraceRecord, tokens: Sequence[int]) -> None:
        self.cache.add_active_response(request_id(rec), list(tokens))

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        rid = request_id(rec)
        self.cache.stop_request(rid)
        if not keep:
            self.cache.evict_cached_response(rid)

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        if kept:
            return
        for r in records:
            hid = f"hist/{request_id(r)}"
            self.cache.start_request(hid, r.prompt_token_ids)
            self.cache.add_active_response(hid, r.response_token_ids)
            self.cache.stop_request(hid)
