"""Probe clocks: when a batch bucket runs a verify that the cost table would not choose.

The decision learns only from the verifies it runs, so in each batch bucket a verify (a probe)
runs whenever ``every`` decode steps of that bucket passed without one (rested steps count:
:meth:`ProbeClock.tick`) while some request's drafts are predicted, at face value (before
calibration), to accept at least ``probe_tokens`` (:class:`SpecCostModel`'s setting).

A probe verifies the batch's draft nodes whose face-value gain is at least ``probe_gain``,
best first, at most ``max(batch size, largest width)`` rows times the bucket's probe size,
whatever the cost table says: the table can be wrong too (a verify's fixed cost measured on
one draft row reads as that row's cost, and every larger verify then looks too slow to try),
and probes of more rows re-measure it. A probe that accepts at least half its face-value
prediction (:meth:`ProbeClock.outcome`) doubles the bucket's probe size (up to the largest
width) and halves its probe interval (down to ``every_min``); one that does not resets both.
So on useless drafts at most one step in ``every`` of a bucket is a probe, of at most twice
the batch's tokens; on good drafts the probes grow until the decision verifies again
(tests/core/test_speculation_recovers.py states the bound).

Standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from rhyme_sglang.core.node_search import DraftNodes
from rhyme_sglang.core.step_table import bucket_of


@dataclass
class BucketProbes:
    """One batch bucket's probe state."""

    steps: int  # decode steps of the bucket
    last_verify: int  # ``steps`` at its last verify
    every: int  # its probe interval
    size: int  # its probe size (times the base cap)


@dataclass
class ProbeClock:
    """Per batch bucket: decode steps since its last verify, its probe interval and size."""

    every: int = 32  # a bucket's decode steps without a verify before a probe
    every_min: int = 4  # the shortest probe interval, after probes that succeeded
    largest: int = 16  # the largest probe size (the largest verify width)
    _buckets: Dict[int, BucketProbes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.every_min <= self.every:
            raise ValueError(f"need 1 <= probe_every_min <= probe_every, got "
                             f"{self.every_min} and {self.every}")

    def _bucket(self, batch_size: int) -> BucketProbes:
        bucket = bucket_of(batch_size)
        state = self._buckets.get(bucket)
        if state is None:
            state = self._buckets[bucket] = BucketProbes(0, 0, self.every, 1)
        return state

    def tick(self, batch_size: int) -> None:
        """Count a decode step of ``batch_size`` requests (every step, decided or rested)."""
        self._bucket(batch_size).steps += 1

    def verified(self, batch_size: int) -> None:
        """A verify ran at ``batch_size``: its bucket's clock starts again."""
        state = self._bucket(batch_size)
        state.last_verify = state.steps

    def due(self, batch_size: int) -> bool:
        """Whether the bucket's probe interval passed without a verify (does not change state)."""
        state = self._bucket(batch_size)
        return state.steps - state.last_verify >= state.every

    def outcome(self, batch_size: int, accepted: int, predicted: float) -> None:
        """The probe just run at ``batch_size`` accepted ``accepted`` drafts of a face-value
        ``predicted``: at least half grows the bucket's probes, less resets them."""
        state = self._bucket(batch_size)
        if accepted >= 0.5 * predicted:
            state.every = max(state.every // 2, self.every_min)
            state.size = min(2 * state.size, self.largest)
        else:
            state.every, state.size = self.every, 1

    def cap(self, batch_size: int) -> int:
        """The most draft rows a probe verifies at this batch size."""
        return max(batch_size, self.largest) * self._bucket(batch_size).size

    def check_integrity(self) -> None:
        """Raise AssertionError where a bucket's state is out of its bounds (not for the hot loop)."""
        for bucket, s in self._buckets.items():
            if not (0 <= s.last_verify <= s.steps and self.every_min <= s.every <= self.every
                    and 1 <= s.size <= self.largest):
                raise AssertionError(f"probe bucket {bucket} out of bounds: {s}")


def probe_counts(batch_size: int, raw: Sequence[Sequence[float]], widths: Tuple[int, ...],
                 min_gain: float, cap: int) -> Tuple[List[int], float]:
    """``(counts, face-value expected accepted drafts)`` of a per-request probe: the batch's
    nodes with a face-value gain (``raw``) of at least ``min_gain``, best first, at most
    ``cap`` (at least the best node)."""
    nodes = DraftNodes(raw, widths[-1])
    take = int(np.count_nonzero(nodes.gain >= min_gain))
    take = min(max(take, 1), cap, len(nodes.gain))
    counts = np.bincount(nodes.request[:take], minlength=batch_size).tolist()
    return counts, float(nodes.gain[:take].sum())


def probe_width(batch_size: int, raw: Mapping[int, float], widths: Tuple[int, ...],
                min_gain: float, cap: int) -> int:
    """A batch-wide probe's width: the widest whose added nodes gain at least ``min_gain``
    each at face value (``raw[w]``: the batch's at width ``w``), within ``cap`` rows."""
    width, gained = widths[0], 0.0
    for below, w in zip((0,) + widths, widths):
        added = float(raw.get(w, 0.0)) - gained
        if batch_size * w > cap or added < min_gain * batch_size * (w - below):
            break
        width, gained = w, float(raw.get(w, 0.0))
    return width
