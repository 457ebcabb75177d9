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
    """One finished response held in the history (`seq` = prompt tail + response tokens)."""

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

    def to_state(self) -> dict:
        """The record as plain data (`seq` stays an int32 array); see `DraftStore.to_state`."""
        return {"key": self.key, "epoch": self.epoch, "sample": self.sample, "seq": self.seq,
                "len": self.response_len, "reward": self.reward, "factor": self.factor,
                "weight": self.weight, "rid": self.request_id, "global": self.in_global}

    @classmethod
    def from_state(cls, state: dict) -> "ResponseRecord":
        """The record `to_state` gave; KeyError, TypeError or ValueError when malformed."""
        return cls(state["key"], int(state["epoch"]), int(state["sample"]), array("i", state["seq"]),
                   int(state["len"]), state["reward"], float(state["factor"]), int(state["weight"]),
                   state["rid"], bool(state["global"]))


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


class EpochRecords(list):
    """One epoch's responses to a prompt, indexed by sample number (``find`` and
    ``next_sample`` in O(1): a prompt sampled thousands of times per epoch, as the lossless
    tests do, made the linear scans quadratic). Mutate it through ``append``/``remove`` only."""

    def __init__(self):
        super().__init__()
        self.by_sample: Dict[int, ResponseRecord] = {}
        self.max_sample = -1

    def append(self, rec: ResponseRecord) -> None:
        super().append(rec)
        self.by_sample.setdefault(rec.sample, rec)
        self.max_sample = max(self.max_sample, rec.sample)

    def extend(self, records) -> None:
        for rec in records:
            self.append(rec)

    def remove(self, rec: ResponseRecord) -> None:
        # by identity: records are dataclasses, and two equal ones are still two responses
        i = next((i for i, r in enumerate(self) if r is rec), None)
        if i is None:
            raise ValueError(f"record of sample {rec.sample} is not in this epoch")
        del self[i]
        if self.by_sample.get(rec.sample) is rec:
            del self.by_sample[rec.sample]
            other = next((r for r in self if r.sample == rec.sample), None)
            if other is not None:
                self.by_sample[rec.sample] = other
        if rec.sample == self.max_sample:
            self.max_sample = max((r.sample for r in self), default=-1)


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

    def find(self, epoch: int, sample: int) -> Optional[ResponseRecord]:
        group = self.records.get(epoch)
        return None if group is None else group.by_sample.get(sample)

    def latest_with_sample(self, sample: int) -> Optional[ResponseRecord]:
        for epoch in sorted(self.records, reverse=True):
            rec = self.find(epoch, sample)
            if rec is not None:
                return rec
        return None

    def next_sample(self, epoch: int) -> int:
        group = self.records.get(epoch)
        return 0 if group is None else 1 + group.max_sample


def tail_of(prompt_token_ids: Sequence[int], config: StoreConfig) -> List[int]:
    n = config.prompt_prefix
    return list(prompt_token_ids[-n:]) if n else []
