"""SGLang's NGRAM corpus (one global trie, recency-ordered children) as a replay baseline."""

from __future__ import annotations

from typing import List, Optional, Sequence

from rhyme_sglang.core.draft import Draft
from rhyme_sglang.core.trace import TraceRecord
from rhyme_sglang.settings import prepare_cpu_env

from .base import DraftSource, request_id

MAX_TRIE_DEPTH = 18  # server default


def import_error() -> Optional[str]:
    """None when SGLang's NgramCorpus can be used, else the reason it cannot."""
    prepare_cpu_env()
    try:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus  # noqa: F401
    except Exception as exc:  # any import-time failure means: skip this baseline
        return f"{type(exc).__name__}: {exc}"
    return None


class NgramSource(DraftSource):
    """breadth=1 gives a chain; the server default (min 1, max 10 BFS breadth) gives a tree."""

    def __init__(self, k: int, tree: bool, capacity: int = 2_000_000) -> None:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
        self.name = "sglang-ngram-tree" if tree else "sglang-ngram"
        self.k = k
        breadth = 10 if tree else 1
        self.corpus = NgramCorpus(max_trie_depth=MAX_TRIE_DEPTH, min_bfs_breadth=1,
                                  max_bfs_breadth=breadth, draft_token_num=k + 1,
                                  capacity=capacity)

    def _put(self, records: List[TraceRecord]) -> None:
        self.corpus.batch_put([r.prompt_token_ids + r.response_token_ids for r in records])
        self.corpus.synchronize()

    def propose(self, rec: TraceRecord, context: Sequence[int], k: int) -> Draft:
        full = rec.prompt_token_ids + list(context)
        ids, mask = self.corpus.batch_get([request_id(rec)], [full[-MAX_TRIE_DEPTH:]], [len(full)])
        n = self.k + 1
        ids, mask = ids.reshape(n).tolist(), mask.reshape(n, n)
        toks, parents = [], []
        index = {0: -1}
        for i in range(1, n):
            anc = [j for j in range(i) if mask[i, j]]
            if not anc or anc[-1] not in index:  # padding rows are not attached to the tree
                continue
            index[i] = len(toks)
            toks.append(int(ids[i]))
            parents.append(index[anc[-1]])
        return _dedupe(toks, parents)

    def finish(self, rec: TraceRecord, keep: bool) -> None:
        self.corpus.erase_match_state([request_id(rec)])
        if keep:
            self._put([rec])

    def end_epoch(self, epoch: int, records: List[TraceRecord], kept: bool) -> None:
        if not kept:
            self._put(records)


def _dedupe(toks: List[int], parents: List[int]) -> Draft:
    """Drop repeated (parent, token) nodes (and their subtrees) that padding can produce."""
    out_t, out_p, remap, seen = [], [], {}, set()
    for i, (t, p) in enumerate(zip(toks, parents)):
        if p != -1 and p not in remap:
            continue
        np_ = remap[p] if p != -1 else -1
        if (np_, t) in seen:
            continue
        seen.add((np_, t))
        remap[i] = len(out_t)
        out_t.append(t)
        out_p.append(np_)
    return Draft(out_t, out_p, [1.0] * len(out_t), float(len(out_t)), 0)
