"""Per-epoch speculation statistics of one RHYME worker (tau, acceptance histogram, waste)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class EpochStats:
    verify_steps: int = 0
    tokens: int = 0  # tokens emitted by verify steps (accepted drafts + bonus)
    drafted: int = 0  # real (non-padding) draft tokens proposed
    accepted: int = 0
    histogram: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, proposed: int, emitted: int) -> None:
        self.verify_steps += 1
        self.tokens += emitted
        self.drafted += proposed
        self.accepted += max(emitted - 1, 0)
        self.histogram[max(emitted - 1, 0)] += 1

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "tokens": self.tokens,
            "tau": self.tokens / self.verify_steps if self.verify_steps else None,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "waste": (self.drafted - self.accepted) / self.accepted if self.accepted else None,
            "accept_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
        }


class SpecStats:
    """Accumulates verify-step outcomes by epoch; lookup latency samples for the median."""

    def __init__(self, max_latency_samples: int = 4096):
        self.by_epoch: dict[int, EpochStats] = defaultdict(EpochStats)
        self._latency_us: list[float] = []
        self._max = max_latency_samples
        self._next = 0
        self.steps: dict = {}  # decode steps by kind: "plain", "verify_w<width>"
        self.held_back = 0  # requests held back a prefill pass for a sibling's prompt (per pass)

    def count_step(self, kind: str) -> None:
        self.steps[kind] = self.steps.get(kind, 0) + 1

    def record(self, epoch: int, proposed: int, emitted: int) -> None:
        self.by_epoch[epoch].record(proposed, emitted)

    def record_lookup(self, micros: float) -> None:
        if len(self._latency_us) < self._max:
            self._latency_us.append(micros)
        else:  # ring buffer of the most recent samples
            self._latency_us[self._next] = micros
            self._next = (self._next + 1) % self._max

    def lookup_us_p50(self):
        if not self._latency_us:
            return None
        ordered = sorted(self._latency_us)
        return ordered[len(ordered) // 2]

    def as_dict(self) -> dict:
        total = EpochStats()
        for e in self.by_epoch.values():
            total.verify_steps += e.verify_steps
            total.tokens += e.tokens
            total.drafted += e.drafted
            total.accepted += e.accepted
            for k, v in e.histogram.items():
                total.histogram[k] += v
        out = total.as_dict()
        out["per_epoch"] = {str(k): v.as_dict() for k, v in sorted(self.by_epoch.items())}
        out["lookup_us_p50"] = self.lookup_us_p50()
        out["decode_steps"] = dict(self.steps)
        out["group_prefill_held"] = self.held_back
        return out
