"""How many of the draft tokens the store predicts verification really accepts.

The draft store predicts a request's accepted drafts as a sum of draft path probabilities;
verification says how many were accepted. :class:`AcceptanceCalibration` keeps the ratio of
exponentially weighted sums of both, overall and per level of one request's prediction
(``CALIBRATION_EDGES``), and scales a new prediction by its level's ratio, shrunk toward the
overall one while that level has few verifies. The cost model reads its expected gains
through it.

:class:`RequestEvidence` corrects one request on top of that: its own recent verifies, what
they accepted against what the calibration expected of them, fading with the tokens it
generates since. The shared calibration is fed by every request of every batch, so in a
rollout's tail (a few long requests left) its sums are those of the full batches that ran
before; stop 44's decision logs (bench_rollout, SmolLM2 fp32) read 51 expected against 17
accepted drafts over 134 batch-2 verifies: the long answers that make the tail (temperature
1.0 text that had left anything in their history) accepted a third of what the batches
before them had.

Standard library only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict

# levels of one request's predicted accepted drafts, each calibrated on its own
CALIBRATION_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
_LOWEST, _HIGHEST = 0.02, 10.0  # the factor's bounds


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
    prior: float = 1.0  # predicted tokens' worth of the overall factor in each level
    factor: float = 1.0  # accepted / predicted drafts, over recent request verifies
    # exponentially weighted [predicted, accepted] drafts, overall and per level
    _overall: list = field(default_factory=lambda: [0.0, 0.0])
    _levels: Dict[int, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"calibration decay must be in (0, 1], got {self.decay}")

    def observe(self, predicted: float, accepted: int) -> None:
        """One request's verify: ``predicted`` accepted drafts, ``accepted`` taken. Sums, not
        a moving average of per-request ratios: those are heavy-tailed (most verifies of poor
        drafts accept 0, a few accept many), and one batch-32 step would replace the whole
        estimate."""
        if predicted <= 0:
            return
        for sums in (self._overall, self._levels.setdefault(_level_of(predicted), [0.0, 0.0])):
            sums[0] = (1 - self.decay) * sums[0] + predicted
            sums[1] = (1 - self.decay) * sums[1] + accepted
        self.factor = _bounded(self._overall[1] / self._overall[0])

    def calibrated(self, predicted: float) -> float:
        """Expected accepted drafts of a request whose drafts the store predicts ``predicted``
        accepted: scaled by its level's ratio, shrunk toward the overall factor while the
        level has few verifies (``prior`` predicted tokens' worth). Per level because a step
        verifies the requests with the highest predictions, and a store can be over-confident
        exactly there."""
        if predicted <= 0:
            return 0.0
        level = self._levels.get(_level_of(predicted))
        if level is None:
            return self.factor * predicted
        ratio = (level[1] + self.prior * self.factor) / (level[0] + self.prior)
        return _bounded(ratio) * predicted

    def by_level(self) -> Dict[str, float]:
        """``{level: factor at its middle}`` for each level verified so far."""
        return {_level_name(k): round(self.calibrated(_level_mid(k)) / _level_mid(k), 4)
                for k in sorted(self._levels)}


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
