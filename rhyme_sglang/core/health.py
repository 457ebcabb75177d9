"""Speculation health: whether RHYME still verifies where the draft store says it would pay.

Rules:

* A decode step is *promising* when some request of it has drafts the store predicts to
  accept at least ``promising_tokens`` tokens at face value (before calibration).
* Over the last ``window`` decode steps, speculation is *starved* when at least
  ``min_steps`` steps were promising and fewer than ``low_share`` of those verified.
* The calibration is *at its bound* when a prediction level's factor sits at its floor.
* Each cause is logged as a warning once per engine, naming it; :meth:`SpecHealth.report`
  gives the same verdict to ``/rhyme/stats`` and the driver's metrics.

Standard library only.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Sequence, Tuple

logger = logging.getLogger(__name__)

OK, AT_BOUND, STARVED = "ok", "calibration_at_bound", "verify_starved"


@dataclass
class SpecHealth:
    window: int = 512  # decode steps the verdict looks back over
    min_steps: int = 128  # promising steps needed before a step share is judged
    low_share: float = 0.015  # under half the probes' least rate (1 in 32 steps)
    promising_tokens: float = 1.0
    _steps: Deque[Tuple[bool, bool]] = field(default_factory=deque, repr=False)  # (promising, verified)
    _promising: int = 0
    _verified: int = 0  # verified promising steps in the window
    _warned: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_steps <= self.window:
            raise ValueError(f"need window >= 1 and 1 <= min_steps <= window, got "
                             f"{self.window} and {self.min_steps}")
        if not 0.0 <= self.low_share <= 1.0:
            raise ValueError(f"low_share must be in [0, 1], got {self.low_share}")

    def record(self, predicted: Sequence[float], verified: bool) -> None:
        """One decode step: each request's predicted accepted drafts at face value (empty
        when the step did not draft), and whether it verified."""
        promising = any(p >= self.promising_tokens for p in predicted)
        self._steps.append((promising, verified))
        self._promising += promising
        self._verified += promising and verified
        if len(self._steps) > self.window:
            old_promising, old_verified = self._steps.popleft()
            self._promising -= old_promising
            self._verified -= old_promising and old_verified

    def report(self, at_bound: List[str]) -> dict:
        """The verdict (``status``: ok, calibration_at_bound or verify_starved) with its
        figures and a message; logs each cause once."""
        share = self._verified / self._promising if self._promising else None
        status, message = OK, ""
        if self._promising >= self.min_steps and share < self.low_share:
            status = STARVED
            message = (f"RHYME verified {self._verified} of {self._promising} recent decode steps "
                       f"whose drafts the store predicts to accept >= {self.promising_tokens:g} "
                       f"token(s); calibration at its floor for levels {at_bound or 'none'}")
        elif at_bound:
            status = AT_BOUND
            message = (f"acceptance calibration at its floor for prediction levels {at_bound}: "
                       "verifies there accepted far fewer drafts than the store predicted")
        if status != OK and status not in self._warned:
            self._warned.add(status)
            logger.warning("rhyme: speculation health %s: %s", status, message)
        return {"status": status, "message": message, "window_steps": len(self._steps),
                "promising_steps": self._promising, "verified_promising_steps": self._verified,
                "verify_share_when_promising": None if share is None else round(share, 4),
                "calibration_at_bound": list(at_bound)}
