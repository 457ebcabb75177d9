"""The rollout's critical path, for the cost model's choice of a decode step.

A synchronous RL step waits for its last response, so a step's tokens shorten the rollout only
up to what its longest request allows. With ``work`` predicted tokens left in the engine (running remainders plus the waiting
queue) and ``longest`` the longest running remainder, the engine needs at least ``longest / (1
+ c)`` more steps, where ``c`` is what the longest requests accept per step; to finish
``work`` tokens in that many steps it needs only ``(1 + c) * work / longest`` tokens a step, so
a step's useful tokens are::

    useful(w) = min(bs + expected[w], (1 + critical[w]) * work / longest)

with ``critical[w]`` the mean expected accepted drafts of the requests within
``CRITICAL_SHARE`` of the longest remainder. A verify that speeds up short requests but not
the long ones then no longer counts as a gain: scored by plain throughput, verifies at full
batches can emit more tokens per second while the long responses fall behind, and the
rollout then takes longer.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import FrozenSet, Tuple

# requests whose predicted remainder is at least this share of the longest are the critical path
CRITICAL_SHARE = 0.8


def remaining_tokens(predicted_length: float, done: int) -> float:
    """A running request's predicted tokens to go: its prompt's predicted length less what it
    generated, and once past two thirds of that, half of what it generated (a response that
    outruns its prompt's mean is in the long tail, where what is left grows with what is
    done), at least 1."""
    if predicted_length < 0 or done < 0:
        raise ValueError(f"predicted_length and done must be >= 0, got {predicted_length}, {done}")
    return max(predicted_length - done, 0.5 * done, 1.0)


@dataclass(frozen=True)
class Horizon:
    """What is left of the engine's work when a decode step is chosen: each running request's
    predicted remaining tokens (batch order, :func:`remaining_tokens`), the waiting queue's
    predicted tokens and the batch indices of ``background`` requests. The module docstring
    says how it caps a step's useful tokens."""

    remaining: Tuple[float, ...]
    queued: float = 0.0
    background: FrozenSet[int] = frozenset()  # batch indices whose tokens are not this rollout's
    longest: float = field(init=False)  # the longest foreground remainder
    work: float = field(init=False)  # every foreground remainder plus the queue

    def __post_init__(self) -> None:
        if not self.remaining or min(self.remaining) <= 0:
            raise ValueError(f"remaining must be non-empty and > 0, got {self.remaining!r}")
        if self.queued < 0:
            raise ValueError(f"queued must be >= 0, got {self.queued}")
        background = frozenset(self.background)
        if any(not isinstance(i, int) or not 0 <= i < len(self.remaining) for i in background):
            raise ValueError(f"background must hold batch indices below {len(self.remaining)}, "
                             f"got {sorted(background, key=repr)!r}")
        if len(background) == len(self.remaining):
            background = frozenset()  # the engine's only work: count it all
        object.__setattr__(self, "background", background)
        object.__setattr__(self, "remaining", tuple(float(r) for r in self.remaining))
        # derived once: useful() runs per candidate draft node on the scheduler's step
        fore = [r for i, r in enumerate(self.remaining) if i not in background]
        object.__setattr__(self, "longest", max(fore))
        object.__setattr__(self, "work", sum(fore) + self.queued)

    def rows(self, batch_size: int) -> int:
        """The foreground rows of a batch of ``batch_size``: the tokens a plain step gives
        this rollout."""
        return batch_size - len(self.background)

    def foreground(self, i: int) -> bool:
        """Whether request ``i``'s tokens are this rollout's (its drafts may be verified)."""
        return i not in self.background

    def critical(self) -> Tuple[int, ...]:
        """Indices of the foreground requests on the critical path (within ``CRITICAL_SHARE``
        of the longest remainder: predictions are per prompt, so near-longest ones count
        alike)."""
        edge = CRITICAL_SHARE * self.longest
        return tuple(i for i, r in enumerate(self.remaining)
                     if r >= edge and i not in self.background)

    def useful(self, tokens: float, critical_gain: float) -> float:
        """Of a step's foreground ``tokens`` (:meth:`rows` + the foreground's accepted drafts),
        those that shorten the rollout when the critical requests accept ``critical_gain``
        drafts each."""
        return min(tokens, self.limit(critical_gain))

    def limit(self, critical_gain):
        """The most tokens a step can use when the critical requests accept ``critical_gain``
        drafts each: ``(1 + critical_gain) * work / longest`` (a number, or elementwise for an
        array of gains)."""
        return (1.0 + critical_gain) * self.work / self.longest
