"""Batch-level speculation budget: speculate only when it is expected to pay.

For a decode step of ``bs`` requests the engine can either verify drafts (one forward over
``bs * n`` tokens, emitting ``bs + expected accepted drafts`` tokens) or run a plain decode
step (``bs`` tokens in, ``bs`` out). :class:`SpecCostModel` keeps measured step times per
batch-size bucket and mode (exponential moving averages, measured on the running machine)
and a calibration factor between the draft store's predicted acceptance (the sum of draft
path probabilities) and what verification actually accepted. ``should_speculate`` picks the
mode with the higher expected tokens per second. Unmeasured buckets are explored once per
mode, and every ``reexplore_every`` decisions the losing mode is measured again so the model
follows drift. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass
class SpecCostModel:
    alpha: float = 0.2  # EMA weight of a new measurement
    reexplore_every: int = 64
    margin: float = 1.0  # speculate when spec throughput > margin * plain throughput
    _time: dict = field(default_factory=dict)  # (bucket, mode) -> seconds per request-step
    _decisions: int = 0
    calibration: float = 1.0  # actual accepted / predicted accepted (EMA)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.reexplore_every < 1:
            raise ValueError(f"reexplore_every must be >= 1, got {self.reexplore_every}")

    def observe_step(self, mode: str, batch_size: int, seconds: float) -> None:
        """Record the wall time of one step (``mode`` is ``"spec"`` or ``"plain"``)."""
        if mode not in ("spec", "plain"):
            raise ValueError(f"mode must be 'spec' or 'plain', got {mode!r}")
        key = (bucket_of(batch_size), mode)
        per_req = seconds / batch_size
        old = self._time.get(key)
        self._time[key] = per_req if old is None else (1 - self.alpha) * old + self.alpha * per_req

    def observe_acceptance(self, predicted: float, accepted: int) -> None:
        """Calibrate the store's acceptance estimate against a verified step."""
        if predicted > 0:
            ratio = min(max(accepted / predicted, 0.1), 10.0)
            self.calibration = (1 - self.alpha) * self.calibration + self.alpha * ratio

    def step_time(self, mode: str, batch_size: int):
        return self._time.get((bucket_of(batch_size), mode))

    def should_speculate(self, batch_size: int, predicted_accepted: float) -> bool:
        """Decide one step; ``predicted_accepted`` is the sum of the drafts' expected accepts."""
        self._decisions += 1
        t_spec, t_plain = self.step_time("spec", batch_size), self.step_time("plain", batch_size)
        if t_spec is None:
            return True
        if t_plain is None:
            return False
        expected = batch_size + self.calibration * predicted_accepted
        spec_rate = expected / (t_spec * batch_size)
        plain_rate = 1.0 / t_plain
        choice = spec_rate > self.margin * plain_rate
        if self._decisions % self.reexplore_every == 0:
            return not choice
        return choice

    def as_dict(self) -> dict:
        buckets = sorted({b for b, _ in self._time})
        return {
            "calibration": self.calibration,
            "seconds_per_request_step": {
                str(b): {m: self._time.get((b, m)) for m in ("spec", "plain")} for b in buckets
            },
        }
