"""Per-step verify width from measured step costs: plain decode or a width from a small set.

For a decode step of ``bs`` requests the engine can run a plain decode (width 0: ``bs`` tokens
in, ``bs`` out) or verify ``w`` draft tokens per request (``bs * (w + 1)`` tokens in,
``bs + accepted`` out). :class:`SpecCostModel` keeps the measured seconds of whole steps per
(power-of-two batch bucket, width), as exponential moving averages normalised per request, and
a calibration factor between the draft store's predicted acceptance (sums of draft path
probabilities) and what verification accepted. :meth:`SpecCostModel.choose_width` returns the
width with the most expected tokens per second::

    rate(w) = (bs + calibration * expected[w]) / seconds(bs, w)

A cell never measured is estimated from a curve of seconds vs tokens per forward fitted over
every measured cell (linear interpolation; beyond the last point, proportional). Unmeasured
cells are tried once when their estimate is within ``explore_within`` of the best known rate,
and every ``reexplore_every`` decisions the runner-up is chosen, so the table follows drift.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

PLAIN = 0  # the width of a plain decode step


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def check_widths(widths: Sequence[int], max_width: Optional[int] = None) -> Tuple[int, ...]:
    """Sorted unique verify widths, each an int >= 1 (and <= ``max_width`` when given)."""
    out = []
    for w in widths:
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"verify widths must be ints >= 1, got {w!r}")
        if max_width is not None and w > max_width:
            raise ValueError(f"verify width {w} exceeds the largest the engine verifies ({max_width})")
        out.append(w)
    if not out:
        raise ValueError("need at least one verify width")
    return tuple(sorted(set(out)))


def default_widths(max_width: int) -> Tuple[int, ...]:
    """Powers of two below ``max_width``, plus ``max_width`` itself (e.g. 16 -> 1, 2, 4, 8, 16)."""
    if max_width < 1:
        raise ValueError(f"max_width must be >= 1, got {max_width}")
    return tuple(sorted({1 << k for k in range(max_width.bit_length()) if 1 << k < max_width}
                        | {max_width}))


@dataclass
class SpecCostModel:
    widths: Tuple[int, ...] = (1, 2, 4, 8, 16)
    alpha: float = 0.2  # EMA weight of a new measurement
    reexplore_every: int = 64
    margin: float = 1.0  # verify only when its rate beats margin * the plain rate
    explore_within: float = 0.5  # try an unmeasured cell if its estimate >= this * best rate
    calibration: float = 1.0  # actual accepted / predicted accepted (EMA)
    _time: Dict[Tuple[int, int], float] = field(default_factory=dict)  # s per request-step
    _decisions: int = 0
    _curve: Optional[list] = None  # (tokens per forward, seconds) of every cell; None = stale

    def __post_init__(self) -> None:
        self.widths = check_widths(self.widths)
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.reexplore_every < 1:
            raise ValueError(f"reexplore_every must be >= 1, got {self.reexplore_every}")
        if not 0.0 <= self.explore_within <= 1.0:
            raise ValueError(f"explore_within must be in [0, 1], got {self.explore_within}")

    @property
    def candidates(self) -> Tuple[int, ...]:
        return (PLAIN,) + self.widths

    # ------------------------------------------------------------------ measurements
    def observe_step(self, batch_size: int, width: int, seconds: float) -> None:
        """Record the wall time of one whole step of ``batch_size`` requests at ``width``."""
        if width != PLAIN and width not in self.widths:
            raise ValueError(f"width must be 0 (plain) or one of {self.widths}, got {width!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        key = (bucket_of(batch_size), width)
        per_req = seconds / batch_size
        old = self._time.get(key)
        self._time[key] = per_req if old is None else (1 - self.alpha) * old + self.alpha * per_req
        self._curve = None

    def observe_acceptance(self, predicted: float, accepted: int) -> None:
        """Calibrate the store's acceptance estimate against a verified step."""
        if predicted > 0:
            ratio = min(max(accepted / predicted, 0.1), 10.0)
            self.calibration = (1 - self.alpha) * self.calibration + self.alpha * ratio

    def seed(self, table: Mapping[Tuple[int, int], float]) -> int:
        """Prior step costs ``{(batch_size, width): seconds per whole step}``, as if measured
        (a cost table of another run or machine); later measurements move them. Returns how
        many cells it took (widths this model does not use are skipped)."""
        taken = 0
        for (batch_size, width), seconds in table.items():
            if width == PLAIN or width in self.widths:
                self._time[(bucket_of(batch_size), width)] = seconds / batch_size
                taken += 1
        self._curve = None
        return taken

    def table(self) -> Dict[Tuple[int, int], float]:
        """The measured cells as ``{(batch bucket, width): seconds per whole step}``, the form
        :meth:`seed` takes (a round trip gives the same model)."""
        return {(b, w): per_req * b for (b, w), per_req in self._time.items()}

    # ------------------------------------------------------------------ estimates
    def step_time(self, batch_size: int, width: int) -> Optional[float]:
        """Measured seconds of a whole step (None when that cell was never measured)."""
        per_req = self._time.get((bucket_of(batch_size), width))
        return None if per_req is None else per_req * batch_size

    def estimate(self, batch_size: int, width: int) -> Optional[float]:
        """Measured seconds of a step, else the tokens-per-forward curve's estimate."""
        measured = self.step_time(batch_size, width)
        if measured is not None:
            return measured
        if self._curve is None:  # rebuilt after a measurement, not per estimate
            self._curve = sorted({b * (w + 1): s * b for (b, w), s in self._time.items()}.items())
        points = self._curve
        if not points:
            return None
        tokens = batch_size * (width + 1)
        if tokens <= points[0][0]:
            return points[0][1] * tokens / points[0][0] if len(points) == 1 else points[0][1]
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        t_last, s_last = points[-1]
        return s_last * tokens / t_last

    # ------------------------------------------------------------------ decision
    def rates(self, batch_size: int, expected: Mapping[int, float]) -> Dict[int, Optional[float]]:
        """Expected tokens per second of each candidate width (None: nothing to estimate from)."""
        out = {}
        for w in self.candidates:
            seconds = self.estimate(batch_size, w)
            gain = 0.0 if w == PLAIN else self.calibration * float(expected.get(w, 0.0))
            out[w] = None if not seconds else (batch_size + gain) / seconds
        return out

    def choose_width(self, batch_size: int, expected: Mapping[int, float]) -> int:
        """The width for one decode step: 0 (plain) or a verify width.

        ``expected[w]``: the batch's summed expected accepted draft tokens when each request
        verifies its ``w`` most probable draft nodes (missing widths count as 0)."""
        self._decisions += 1
        useful = [w for w in self.widths if expected.get(w, 0.0) > 0.0]
        if not useful:
            return PLAIN
        if self.step_time(batch_size, PLAIN) is None:
            return PLAIN  # measure the baseline first
        rates = self.rates(batch_size, expected)
        plain_rate = rates[PLAIN]
        known = {w: rates[w] for w in useful if self.step_time(batch_size, w) is not None}
        best_known = max([plain_rate] + list(known.values()))
        for w in sorted(useful, key=lambda w: -(rates[w] or float("inf"))):
            if w not in known and (rates[w] is None or rates[w] >= self.explore_within * best_known):
                return w  # explore a promising cell once
        scored = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                        reverse=True)
        ranking = [w for _, w in scored] + [PLAIN]
        if self._decisions % self.reexplore_every == 0 and len(known) + 1 > 1:
            alternatives = [w for w in (PLAIN,) + tuple(known) if w != ranking[0]]
            return max(alternatives, key=lambda w: rates[w] or 0.0)
        return ranking[0]

    def as_dict(self) -> dict:
        buckets = sorted({b for b, _ in self._time})
        return {
            "calibration": self.calibration,
            "widths": list(self.widths),
            "seconds_per_request_step": {
                str(b): {str(w): self._time[(b, w)] for w in self.candidates if (b, w) in self._time}
                for b in buckets
            },
        }
