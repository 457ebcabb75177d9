"""How many of the draft tokens the store predicts verification really accepts.

The draft store predicts a request's accepted drafts as a sum of draft path probabilities;
verification says how many were accepted. :class:`AcceptanceCalibration` keeps exponentially
weighted sums of both (and of the verifies behind them), per level of one request's
prediction (``CALIBRATION_EDGES``), and scales a new prediction by its level's factor.

Rules:

* Every factor is a ratio of sums shrunk toward a prior worth ``prior`` verifies of the
  evidence's mean size: after ``n`` misses and nothing else a factor is
  ``prior / (prior + n)`` of its prior, so a handful of misses lowers it and none pins it to
  its floor (``_LOWEST``). With decay ``d`` the sums hold at most ``1 / d`` verifies, so the
  lowest a factor gets after any run of misses is ``prior / (prior + 1 / d)`` of its prior
  (0.074 at the defaults).
* A level's prior is the factor of the levels above it (predictions at least as confident),
  itself shrunk toward face value (factor 1): misses of 0.3-token guesses say nothing of
  6-token drafts on a perfect history, while a confident level that is wrong says the weaker
  ones are too.
* A verify is filed under the level of the prediction its decision was scaled by (``level``
  in :meth:`AcceptanceCalibration.observe`: a request's whole draft), even when it verified
  only part of the draft, so the level that decides is the level that learns.
* :meth:`AcceptanceCalibration.forget` keeps a share of the evidence when the history changes
  (a new epoch, imported history, new weights): acceptance measured on the old history is
  weaker evidence about the new one.

:class:`RequestEvidence` corrects one request on top of that: its own recent verifies, what
they accepted against what the calibration expected of them, fading with the tokens it
generates since (the long answers of a rollout's tail can accept far less than the full
batches that fed the shared calibration).

Standard library only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# levels of one request's predicted accepted drafts, each calibrated on its own
CALIBRATION_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
_LOWEST, _HIGHEST = 0.02, 10.0  # the factor's bounds
PRIOR_VERIFIES = 4.0  # verifies' worth of the prior behind each factor (benchmarks/calibration_prior.py)


def _level_of(predicted: float) -> int:
    return bisect.bisect_right(CALIBRATION_EDGES, predicted)


def _level_name(k: int) -> str:
    lo = CALIBRATION_EDGES[k - 1] if k > 0 else 0.0
    return f"{lo:g}+" if k == len(CALIBRATION_EDGES) else f"{lo:g}-{CALIBRATION_EDGES[k]:g}"


def _level_mid(k: int) -> float:
    lo = CALIBRATION_EDGES[k - 1] if k > 0 else 0.0
    hi = CALIBRATION_EDGES[k] if k < len(CALIBRATION_EDGES) else 2 * lo
    return (lo + hi) / 2


def _bounded(ratio: float) -> float:
    return min(max(ratio, _LOWEST), _HIGHEST)


@dataclass
class AcceptanceCalibration:
    decay: float = 0.02  # weight of one request's verify in the sums
    prior: float = PRIOR_VERIFIES  # verifies' worth of each factor's prior
    # exponentially weighted [verifies, predicted, accepted drafts], overall and per level
    _overall: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _levels: Dict[int, List[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"calibration decay must be in (0, 1], got {self.decay}")
        if not self.prior > 0.0:
            raise ValueError(f"calibration prior must be > 0 verifies, got {self.prior}")

    def observe(self, predicted: float, accepted: int, level: Optional[float] = None) -> None:
        """One request's verify: ``predicted`` accepted drafts (of the nodes it verified),
        ``accepted`` taken; filed under ``level``'s prediction level (default ``predicted``).
        Sums, not a moving average of per-request ratios: those are heavy-tailed (most
        verifies of poor drafts accept 0, a few accept many)."""
        if predicted <= 0:
            return
        key = _level_of(predicted if level is None else level)
        for sums in (self._overall, self._levels.setdefault(key, [0.0] * 3)):
            keep = 1 - self.decay
            sums[0] = keep * sums[0] + 1.0
            sums[1] = keep * sums[1] + predicted
            sums[2] = keep * sums[2] + accepted

    def forget(self, keep: float = 0.5) -> None:
        """Keep ``keep`` of every sum's weight: the history the evidence was measured on has
        changed."""
        if not 0.0 <= keep <= 1.0:
            raise ValueError(f"keep must be in [0, 1], got {keep}")
        for sums in [self._overall, *self._levels.values()]:
            for i in range(3):
                sums[i] *= keep

    def _shrunk(self, n: float, predicted: float, accepted: float, prior_factor: float,
                size: float) -> float:
        """Accepted over predicted drafts with ``prior`` verifies at ``prior_factor``, each
        the evidence's mean prediction (``size`` without evidence)."""
        if n > 0:
            size = predicted / n
        weight = self.prior * size
        return _bounded((accepted + weight * prior_factor) / (predicted + weight))

    @property
    def factor(self) -> float:
        """Accepted over predicted drafts over recent verifies of every level, shrunk toward
        face value."""
        return self._shrunk(*self._overall, prior_factor=1.0, size=1.0)

    def level_factor(self, k: int) -> float:
        """Level ``k``'s factor: its own evidence shrunk toward the levels above it, theirs
        toward face value (module docstring)."""
        above = [sum(s[i] for j, s in self._levels.items() if j > k) for i in range(3)]
        base = self._shrunk(*above, prior_factor=1.0, size=_level_mid(k))
        return self._shrunk(*self._levels.get(k, (0.0, 0.0, 0.0)), prior_factor=base,
                            size=_level_mid(k))

    def calibrated(self, predicted: float) -> float:
        """Expected accepted drafts of a request whose drafts the store predicts ``predicted``
        accepted: scaled by its level's factor."""
        if predicted <= 0:
            return 0.0
        return self.level_factor(_level_of(predicted)) * predicted

    def at_bound(self, within: float = 1.5) -> List[str]:
        """The levels with evidence whose factor is within ``within`` times the floor."""
        return [_level_name(k) for k in sorted(self._levels)
                if self.level_factor(k) <= _LOWEST * within]

    def by_level(self) -> Dict[str, float]:
        """``{level: factor}`` for each level verified so far."""
        return {_level_name(k): round(self.level_factor(k), 4) for k in sorted(self._levels)}


_REQUEST_LOWEST, _REQUEST_HIGHEST = 0.05, 4.0  # the request factor's bounds


@dataclass
class RequestEvidence:
    """One request's verifies: accepted drafts and what the calibration expected of them, both
    multiplied by ``fade`` per token it generated since (its recent text is what predicts its
    next drafts). :meth:`factor` scales the calibration's expectation for this request: 1
    with no evidence, ``prior`` expected tokens' worth of "as calibrated" pulling it there."""

    prior: float = 1.0
    fade: float = 0.97  # per generated token (half-life ~23 tokens)
    expected: float = 0.0
    accepted: float = 0.0

    def __post_init__(self) -> None:
        if self.prior <= 0 or not 0.0 < self.fade <= 1.0:
            raise ValueError(f"need prior > 0 and fade in (0, 1], got {self.prior}, {self.fade}")

    def advance(self, tokens: int) -> None:
        """The request generated ``tokens`` more tokens (plain steps, or a verify's)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        keep = self.fade ** tokens
        self.expected *= keep
        self.accepted *= keep

    def observe(self, expected: float, accepted: int, tokens: int) -> None:
        """A verify that the calibration expected to accept ``expected`` drafts accepted
        ``accepted`` and emitted ``tokens`` tokens (older evidence fades by them first)."""
        if expected < 0 or accepted < 0:
            raise ValueError(f"need expected >= 0 and accepted >= 0, got {expected}, {accepted}")
        self.advance(tokens)
        self.expected += expected
        self.accepted += accepted

    def factor(self) -> float:
        """Accepted over expected drafts, shrunk toward 1 by ``prior``, within [0.05, 4]."""
        ratio = (self.accepted + self.prior) / (self.expected + self.prior)
        return min(max(ratio, _REQUEST_LOWEST), _REQUEST_HIGHEST)
