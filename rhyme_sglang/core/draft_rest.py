"""Decode steps on which the worker does not draft at all, after the cost model said plainly
that a verify would lose.

Standard library (and the cost model's ``PLAIN``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rhyme_sglang.core.cost_model import PLAIN


@dataclass
class DraftRest:
    """Steps on which the worker does not draft at all, because the cost model has just said
    that a verify would lose clearly.

    A decode step's drafts cost a store lookup per request before the cost model can decide,
    and where drafts do not pay the decision is plain step after step. After a plain
    decision whose best verify rate was under ``below`` times the plain rate, the next
    ``2 ** streak - 1`` steps (at most ``longest``) are plain without drafting; a verify or a
    close call ends the rest, and so does a request new to the batch (its drafts are unknown).
    Which steps verify never changes what is sampled, so this only moves speed."""

    below: float = 0.95
    longest: int = 7
    _streak: int = 0
    _left: int = 0
    rested: int = 0  # steps that skipped drafting

    def __post_init__(self) -> None:
        if not 0.0 <= self.below <= 1.0:
            raise ValueError(f"below must be in [0, 1], got {self.below}")
        if self.longest < 0:
            raise ValueError(f"longest must be >= 0, got {self.longest}")

    def resting(self, new_requests: bool) -> bool:
        """Whether this step skips drafting (called once per decode step)."""
        if new_requests:
            self._streak = self._left = 0
        if self._left <= 0:
            return False
        self._left -= 1
        self.rested += 1
        return True

    def decided(self, width: int, advantage: Optional[float]) -> None:
        """The cost model's decision for a step that drafted: its width and advantage
        (:class:`rhyme_sglang.core.cost_model.Decision`)."""
        if width == PLAIN and advantage is not None and advantage < self.below:
            self._streak += 1
            self._left = min((1 << min(self._streak, 16)) - 1, self.longest)
        else:
            self._streak = self._left = 0
