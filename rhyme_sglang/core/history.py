"""Per-prompt state: finished-response records, the prompt's history trie and its live trie."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .config import StoreConfig
from .window import SpecWindow


def prompt_key(prompt_token_ids: Sequence[int], prompt_id: Optional[str] = None) -> str:
    """The explicit prompt id, else a stable hash of the prompt's token ids."""
    if prompt_id is not None:
        if not isinstance(prompt_id, str) or not prompt_id:
            raise ValueError(f"prompt_id must be a non-empty str, got {prompt_id!r}")
        return prompt_id
    data = check_tokens(prompt_token_ids, "prompt_token_ids").tobytes()
    return "h:" + hashlib.blake2b(data, digest_size=12).hexdigest()


def check_tokens(tokens: Sequence[int], name: str) -> array:
    """Token ids as an int32 array; ValueError for non-ints, negatives or ids >= 2**31."""
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of ints, got {tokens!r:.80}")
    try:
        out = array("i", tokens)
    except (TypeError, OverflowError, ValueError):
        raise ValueError(f"{name} must be a sequence of ints in [0, 2**31), got {tokens!r:.80}") from None
    if out and min(out) < 0:
        raise ValueError(f"{name} has a negative token id {min(out)}")
    return out


@dataclass
class ResponseRecord:
    """One finished response held in the history (`seq` = prompt tail + response tokens).

    A `run_ahead` record is draft-only: a run-ahead request's tokens (finished or aborted). It
    drafts with its weight scaled by `StoreConfig.run_ahead_weight`, takes no reward, has its
    own sample numbers (never colliding with a real response's) and no length statistics."""

    key: str
    epoch: int
    sample: int
    seq: array
    response_len: int
    reward: Optional[float] = None
    factor: float = 1.0
    weight: int = 0
    request_id: Optional[str] = None
    in_global: bool = False
    alive: bool = True
    run_ahead: bool = False

    def to_state(self) -> dict:
        """The record as plain data (`seq` stays an int32 array); see `DraftStore.to_state`.
        `"run_ahead": True` only on draft-only records (absent means False)."""
        out = {"key": self.key, "epoch": self.epoch, "sample": self.sample, "seq": self.seq,
               "len": self.response_len, "reward": self.reward, "factor": self.factor,
               "weight": self.weight, "rid": self.request_id, "global": self.in_global}
        if self.run_ahead:
            out["run_ahead"] = True
        return out

    @classmethod
    def from_state(cls, state: dict) -> "ResponseRecord":
        """The record `to_state` gave; KeyError, TypeError or ValueError when malformed."""
        run_ahead = state.get("run_ahead", False)
        if not isinstance(run_ahead, bool):
            raise ValueError(f"record run_ahead must be a bool, got {run_ahead!r}")
        if run_ahead and state["reward"] is not None:
            raise ValueError("a run-ahead record takes no reward")
        return cls(state["key"], int(state["epoch"]), int(state["sample"]), array("i", state["seq"]),
                   int(state["len"]), state["reward"], float(state["factor"]), int(state["weight"]),
                   state["rid"], bool(state["global"]), run_ahead=run_ahead)


@dataclass
class ActiveRequest:
    """A request being generated: its context (prompt tail + generated tokens) and window."""

    request_id: str
    key: str
    sample: Optional[int]
    epoch: int
    prefix_len: int
    seq: array
    window: SpecWindow
    reward: Optional[float] = None
    last_draft: Optional[object] = None
    stream: int = -1  # the live trie's handle of `seq` as a growing stream (SuffixTrie.open_stream)
    run_ahead: bool = False  # its response joins the history as a draft-only record


class EpochRecords(list):
    """One epoch's responses to a prompt, indexed by sample number (``find`` and
    ``next_sample`` in O(1): a prompt sampled thousands of times per epoch, as the lossless
    tests do, made the linear scans quadratic). Real and run-ahead (draft-only) records have
    separate sample spaces, each with its own index. Mutate it through ``append``/``remove``
    only."""

    def __init__(self):
        super().__init__()
        self._index: Dict[bool, Dict[int, ResponseRecord]] = {False: {}, True: {}}
        self._max: Dict[bool, int] = {False: -1, True: -1}

    def find(self, sample: int, run_ahead: bool = False) -> Optional[ResponseRecord]:
        return self._index[run_ahead].get(sample)

    def next_sample(self, run_ahead: bool = False) -> int:
        return 1 + self._max[run_ahead]

    def append(self, rec: ResponseRecord) -> None:
        super().append(rec)
        self._index[rec.run_ahead].setdefault(rec.sample, rec)
        self._max[rec.run_ahead] = max(self._max[rec.run_ahead], rec.sample)

    def extend(self, records) -> None:
        for rec in records:
            self.append(rec)

    def remove(self, rec: ResponseRecord) -> None:
        # by identity: records are dataclasses, and two equal ones are still two responses
        i = next((i for i, r in enumerate(self) if r is rec), None)
        if i is None:
            raise ValueError(f"record of sample {rec.sample} is not in this epoch")
        del self[i]
        kind, index = rec.run_ahead, self._index[rec.run_ahead]
        if index.get(rec.sample) is rec:
            del index[rec.sample]
            other = next((r for r in self if r.sample == rec.sample and r.run_ahead == kind), None)
            if other is not None:
                index[rec.sample] = other
        if rec.sample == self._max[kind]:
            self._max[kind] = max((r.sample for r in self if r.run_ahead == kind), default=-1)


@dataclass
class PromptHistory:
    """Everything the store keeps for one prompt."""

    key: str
    prompt_tail: List[int]
    tree: object
    records: Dict[int, EpochRecords] = field(default_factory=dict)
    live: Optional[object] = None
    live_prompt: Optional[array] = None
    num_active: int = 0

    def num_records(self) -> int:
        return sum(len(v) for v in self.records.values())

    def group(self, epoch: int) -> EpochRecords:
        """The epoch's records, created empty on first use."""
        group = self.records.get(epoch)
        if group is None:
            group = self.records[epoch] = EpochRecords()
        return group

    def find(self, epoch: int, sample: int, run_ahead: bool = False) -> Optional[ResponseRecord]:
        """The record of (epoch, sample) among the real responses, or among the draft-only
        ones with `run_ahead`."""
        group = self.records.get(epoch)
        return None if group is None else group.find(sample, run_ahead)

    def latest_with_sample(self, sample: int) -> Optional[ResponseRecord]:
        for epoch in sorted(self.records, reverse=True):
            rec = self.find(epoch, sample)
            if rec is not None:
                return rec
        return None

    def next_sample(self, epoch: int, run_ahead: bool = False) -> int:
        group = self.records.get(epoch)
        return 0 if group is None else group.next_sample(run_ahead)


def tail_of(prompt_token_ids: Sequence[int], config: StoreConfig) -> List[int]:
    n = config.prompt_prefix
    return list(prompt_token_ids[-n:]) if n else []
