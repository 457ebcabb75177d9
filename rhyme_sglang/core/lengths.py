"""Per-prompt response-length statistics and a length predictor for scheduling."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

_VERSIONS = itertools.count(1)


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
    prompts' latest-epoch means, or `default` when nothing is known. `version` changes whenever
    the statistics do (unique across instances, so a store that loads a snapshot gets a new one),
    so callers (the scheduler's ordering hook) can cache predictions.
    """

    def __init__(self, default: float = 512.0) -> None:
        if default < 0:
            raise ValueError(f"default length must be >= 0, got {default}")
        self.default = default
        self._lengths: Dict[str, Dict[int, Dict[int, int]]] = {}
        self.version = next(_VERSIONS)
        self._fallback: Optional[Tuple[int, float]] = None  # (version, prediction for unknowns)

    def record(self, key: str, epoch: int, sample: int, length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self._lengths.setdefault(key, {}).setdefault(epoch, {})[sample] = length
        self.version = next(_VERSIONS)

    def forget(self, key: str) -> None:
        if self._lengths.pop(key, None) is not None:
            self.version = next(_VERSIONS)

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
        s = self.summary(key) if key is not None else None
        if s is not None:
            return max(1.0, s.mean + 0.5 * s.trend)
        if self._fallback is None or self._fallback[0] != self.version:
            means = [self.summary(k).mean for k in self._lengths]
            self._fallback = (self.version, sum(means) / len(means) if means else self.default)
        return self._fallback[1]

    def to_state(self) -> dict:
        return {k: {str(e): {str(s): n for s, n in v.items()} for e, v in eps.items()}
                for k, eps in self._lengths.items()}

    def load_state(self, state: dict) -> None:
        self._lengths = {k: {int(e): {int(s): int(n) for s, n in v.items()} for e, v in eps.items()}
                         for k, eps in state.items()}
        self.version = next(_VERSIONS)

    def estimate_memory(self) -> int:
        return sum(100 + 80 * sum(len(v) for v in eps.values()) for eps in self._lengths.values())

    def check_integrity(self) -> bool:
        return all(n >= 0 for eps in self._lengths.values() for v in eps.values() for n in v.values())
