"""Per-prompt response-length statistics and a length predictor for scheduling."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional

_UNKNOWN = object()  # memo key of the prediction for prompts without statistics
# forgotten prompts whose latest-epoch means still inform the unknown-prompt prediction
FORGOTTEN_MEANS = 4096


@dataclass(frozen=True)
class LengthSummary:
    """Lengths of a prompt's latest epoch, with the change of the mean since the epoch before."""

    epoch: int
    lengths: Dict[int, int]
    mean: float
    max: int
    trend: float


class LengthStats:
    """Response lengths per (prompt key, epoch, sample).

    Prediction for a known prompt: mean of its latest epoch plus half the epoch-over-epoch trend
    (damped, lengths drift slowly under RL), floored at 1. Unknown prompts get the mean of all
    prompts' latest-epoch means, or `default` when nothing is known. A forgotten prompt (dropped
    or evicted from the store) leaves its latest-epoch mean to that unknown-prompt mean, the
    latest `FORGOTTEN_MEANS` of them, until its statistics are recorded again: an engine that
    holds only a step's prompts then predicts an unseen prompt as one that kept every prompt
    would. Predictions are memoised until the statistics change: the scheduler's ordering hook
    asks on every scheduling pass.
    """

    def __init__(self, default: float = 512.0) -> None:
        if default < 0:
            raise ValueError(f"default length must be >= 0, got {default}")
        self.default = default
        self._lengths: Dict[str, Dict[int, Dict[int, int]]] = {}
        self._memo: dict = {}  # key (or _UNKNOWN) -> prediction; cleared by every change
        self._forgotten: "OrderedDict[str, float]" = OrderedDict()  # key -> its last mean

    def record(self, key: str, epoch: int, sample: int, length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self._lengths.setdefault(key, {}).setdefault(epoch, {})[sample] = length
        self._forgotten.pop(key, None)  # back: its own statistics count
        self._memo.clear()

    def forget(self, key: str) -> None:
        summary = self.summary(key)
        if self._lengths.pop(key, None) is not None:
            if summary is not None:
                self._forgotten.pop(key, None)
                self._forgotten[key] = summary.mean
                while len(self._forgotten) > FORGOTTEN_MEANS:
                    self._forgotten.popitem(last=False)
            self._memo.clear()

    def keys(self) -> List[str]:
        return list(self._lengths)

    def summary(self, key: str) -> Optional[LengthSummary]:
        epochs = self._lengths.get(key)
        if not epochs:
            return None
        order = sorted(epochs)
        last = epochs[order[-1]]
        mean = sum(last.values()) / len(last)
        trend = 0.0
        if len(order) >= 2:
            prev = epochs[order[-2]]
            trend = mean - sum(prev.values()) / len(prev)
        return LengthSummary(order[-1], dict(last), mean, max(last.values()), trend)

    def predict(self, key: Optional[str]) -> float:
        out = self._memo.get(key)
        if out is None:
            s = self.summary(key) if key is not None else None
            if s is not None:
                out = max(1.0, s.mean + 0.5 * s.trend)
            else:
                out = self._memo.get(_UNKNOWN)
                if out is None:
                    means = [self.summary(k).mean for k in self._lengths]
                    means += self._forgotten.values()
                    out = self._memo[_UNKNOWN] = sum(means) / len(means) if means else self.default
            self._memo[key] = out
        return out

    def to_state(self) -> dict:
        return {k: {str(e): {str(s): n for s, n in v.items()} for e, v in eps.items()}
                for k, eps in self._lengths.items()}

    def load_state(self, state: dict) -> None:
        self._lengths = {k: {int(e): {int(s): int(n) for s, n in v.items()} for e, v in eps.items()}
                         for k, eps in state.items()}
        self._memo.clear()
        self._forgotten.clear()

    def estimate_memory(self) -> int:
        return (sum(100 + 80 * sum(len(v) for v in eps.values()) for eps in self._lengths.values())
                + 100 * len(self._forgotten))

    def check_integrity(self) -> bool:
        return all(n >= 0 for eps in self._lengths.values() for v in eps.values() for n in v.values())
