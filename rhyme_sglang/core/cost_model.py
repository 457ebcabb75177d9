"""Per-step verify width from measured step costs: plain decode or a width from a small set.

For a decode step of ``bs`` requests the engine can run a plain decode (width 0: ``bs`` tokens
in, ``bs`` out) or verify ``w`` draft tokens per request (``bs * (w + 1)`` tokens in,
``bs + accepted`` out). :class:`SpecCostModel` keeps (in a
:class:`rhyme_sglang.core.step_table.StepCostTable`) the measured seconds of whole steps per
(power-of-two batch bucket, width), with the batch size they were measured at (both as
exponential moving averages), reads a width's cost at any batch size piecewise linearly
between its cells (a step costs a fixed part plus a part per token, so seconds per request
fall with batch size: a cell measured at 17 requests overstates 32 requests' cost when scaled
per request), and a calibration factor between the draft store's predicted acceptance (sums
of draft path probabilities) and what verification accepted
(:mod:`rhyme_sglang.core.calibration`). :meth:`SpecCostModel.choose_width` returns the width
with the most expected tokens per second::

    rate(w) = (bs + calibration * expected[w]) / seconds(bs, w)

A cell never measured is estimated from a curve of seconds vs tokens per forward fitted over
every measured cell (linear interpolation; beyond the last point, proportional). Unmeasured
cells are tried once when their estimate is within ``explore_within`` of the best known rate.

Per-request widths (a ragged verify): :meth:`SpecCostModel.choose_rows` takes, from every
draft node of the batch, the most probable ones, as many as maximise::

    rate(K) = (bs + sum of the K largest calibrated node probabilities) / seconds(bs, K rows)

with ``seconds(bs, K)`` piecewise linear in the step's draft rows through the bucket's plain
cell and its verify cells; each cell also keeps (as an EMA) the tokens its steps' forwards ran,
so a cell stands for the ragged steps it measured. Its cell is the smallest width that holds
the step's largest request.

Probes: the decision learns only from the verifies it runs, so in each batch bucket a verify
is run whenever ``probe_every`` decode steps of that bucket (rested steps included:
:meth:`SpecCostModel.tick`) passed without one while some request's drafts are predicted, at
face value (``raw``: before calibration), to accept at least ``probe_tokens``. A probe
verifies the batch's draft nodes whose face-value gain is at least ``probe_gain``, best
first, at most ``max(batch size, largest width)`` rows times the bucket's probe size,
whatever the cost table says: the table can be wrong too (a verify's fixed cost measured on
one draft row reads as that row's cost, and every larger verify then looks too slow to try),
and probes of more rows re-measure it. A probe that accepts at least half its face-value
prediction (:meth:`SpecCostModel.probe_outcome`) doubles the bucket's probe size (up to the
largest width) and halves its probe interval (down to ``probe_every_min``); one that does
not resets both. So on useless drafts at most one step in ``probe_every`` of a bucket is a
probe, of at most twice the batch's tokens; on good drafts the probes grow until the
decision verifies again (tests/core/test_speculation_recovers.py states the bound).

A step's useful tokens can be capped by the rollout's critical path (a
:class:`rhyme_sglang.core.horizon.Horizon`, optional; see that module).

The table must not be poisoned by one bad step, because a cell that looks slow is never
chosen again and so never corrected: on a 2-core CPU a batch-32 plain-decode cell read 1.54 s
where vanilla's steps took 0.49 s, and RHYME then verified every step of that bucket at x0.63
of vanilla's throughput. So:

* a measurement moves a cell at most ``max_jump`` times its current value (a one-off stall,
  a weight repack or a neighbour's burst, cannot multiply a cell by 10; a lasting change still
  gets there in a few steps);
* every ``reexplore_every`` decisions the stalest alternative of the bucket (the measured
  cell this model observed longest ago, or never: seeded cells count as never) is chosen
  instead of the best, so every competitive cell is refreshed, the plain baseline always
  (a verify cell whose rate is under ``explore_within`` of the best is not: re-running it
  costs a slow step, and ``max_jump`` keeps one stall from pushing a cell that far);
* a verify is judged against plain steps this model measured at the batch size, or within
  ``baseline_near`` of it (a plain step is run first where there are none), never against a
  cell extrapolated from other sizes, and where a verify wins by less than ``close_call``
  the bucket's plain step is re-run every ``close_refresh`` decisions (stop 39: a plain cell
  measured in one slow round kept width-1 verifies chosen for the next two at batch 16,
  49 ms a step against plain steps of 38-39 ms); a seeded cell is a prior that its first
  measurement replaces (stop 14: seeds from an earlier run
  read a batch-16 plain step at 0.56 s against vanilla's 0.38-0.39 s, and at alpha 0.2 the
  engine's own measurements took many refreshes to pull it down).

Standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from rhyme_sglang.core.calibration import PRIOR_VERIFIES, AcceptanceCalibration
from rhyme_sglang.core.horizon import Horizon
from rhyme_sglang.core.node_search import DraftNodes, best_prefix
from rhyme_sglang.core.step_table import PLAIN, StepCostTable, bucket_of

__all__ = ["PLAIN", "SpecCostModel", "bucket_of", "check_widths", "default_widths"]


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
    calibration_decay: float = 0.02  # weight of one request's verify in the calibration's sums
    calibration_prior: float = PRIOR_VERIFIES  # verifies' worth of each calibration factor's prior
    probe_every: int = 32  # a bucket's decode steps without a verify before a probe (module docstring)
    probe_tokens: float = 1.0  # ... when a request's drafts predict at least this many accepted
    probe_gain: float = 0.5  # a probe verifies the nodes with at least this face-value gain
    probe_every_min: int = 4  # the shortest probe interval, after probes that succeeded
    max_jump: float = 2.0  # one measurement moves a cell by at most this factor
    baseline_near: float = 0.1  # plain measured within this fraction of a batch size (>= 1 request)
    close_call: float = 1.25  # a verify winning by less than this factor over plain ...
    close_refresh: int = 8  # ... re-measures plain when the bucket ran none for this many decisions
    _decisions: int = 0  # the clock the step table's measurements are stamped with
    _calibration: AcceptanceCalibration = field(init=False)
    steps: StepCostTable = field(init=False, repr=False)  # the measured step costs
    # the last decision's best verify rate over the plain rate (0: no verify had a gain;
    # None: plain was chosen to measure it); the worker skips drafting after clear losses
    last_advantage: Optional[float] = None
    # why the last decision chose what it did: "best", "explore" (a cell not yet run here),
    # "reexplore" (the stalest cell, every reexplore_every decisions), "close_call", "probe"
    last_reason: str = "best"
    # bucket -> [decode steps of the bucket, that count at its last verify, probe interval,
    # probe size]
    _probe_clock: Dict[int, list] = field(default_factory=dict, repr=False)
    last_probe_predicted: float = 0.0  # the last probe's face-value expected accepted drafts
    last_promising: bool = False  # the last decision's drafts would have allowed a probe

    def __post_init__(self) -> None:
        self.widths = check_widths(self.widths)
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.reexplore_every < 1:
            raise ValueError(f"reexplore_every must be >= 1, got {self.reexplore_every}")
        if not 0.0 <= self.explore_within <= 1.0:
            raise ValueError(f"explore_within must be in [0, 1], got {self.explore_within}")
        if not 0.0 < self.calibration_decay <= 1.0:
            raise ValueError(f"calibration_decay must be in (0, 1], got {self.calibration_decay}")
        self._calibration = AcceptanceCalibration(self.calibration_decay, self.calibration_prior)
        if not self.max_jump > 1.0:
            raise ValueError(f"max_jump must be > 1, got {self.max_jump}")
        if self.close_call < 1.0 or self.close_refresh < 1:
            raise ValueError(f"close_call must be >= 1 and close_refresh >= 1, got "
                             f"{self.close_call} and {self.close_refresh}")
        if not 0.0 <= self.baseline_near < 1.0:
            raise ValueError(f"baseline_near must be in [0, 1), got {self.baseline_near}")
        if not 1 <= self.probe_every_min <= self.probe_every:
            raise ValueError(f"need 1 <= probe_every_min <= probe_every, got "
                             f"{self.probe_every_min} and {self.probe_every}")
        self.steps = StepCostTable(self.widths, self.alpha, self.max_jump, self.baseline_near)

    @property
    def calibration(self) -> float:
        """Accepted over predicted drafts, over recent request verifies (all levels)."""
        return self._calibration.factor

    @property
    def candidates(self) -> Tuple[int, ...]:
        return (PLAIN,) + self.widths

    # ------------------------------------------------------------------ measurements
    def observe_step(self, batch_size: int, width: int, seconds: float,
                     rows: Optional[int] = None, contexts: Optional[Sequence[int]] = None,
                     lens: Optional[Sequence[int]] = None) -> None:
        """Record the wall time of one whole step of ``batch_size`` requests at ``width``
        (``rows``: the forward's tokens, for a ragged verify; :meth:`StepCostTable.observe`).
        ``contexts``: each request's context tokens (unknown: the step counts as
        context-free); ``lens``: each request's forward rows in a ragged verify."""
        keys = _keys(contexts, batch_size)
        row_keys = width * keys
        if contexts is not None and lens is not None:
            if len(lens) != batch_size:
                raise ValueError(f"need one len per request ({batch_size}), got {len(lens)}")
            row_keys = float(sum((n - 1) * c for n, c in zip(lens, contexts)))
        self.steps.observe(batch_size, width, seconds, rows, now=self._decisions, keys=keys,
                           row_keys=row_keys)
        if width != PLAIN:
            self.verified(batch_size)

    # ------------------------------------------------------------------ probes
    def _clock(self, batch_size: int) -> list:
        return self._probe_clock.setdefault(bucket_of(batch_size), [0, 0, self.probe_every, 1])

    def tick(self, batch_size: int) -> None:
        """Count a decode step of ``batch_size`` requests on the probe clock (every step:
        :meth:`choose_rows` and :meth:`choose_width` call it, the caller calls it for a step
        that did not ask them, e.g. one that skipped drafting)."""
        self._clock(batch_size)[0] += 1

    def verified(self, batch_size: int) -> None:
        """A verify ran at ``batch_size``: its bucket's probe clock starts again."""
        clock = self._clock(batch_size)
        clock[1] = clock[0]

    def probe_due(self, batch_size: int) -> bool:
        """Whether the bucket's probe interval passed without a verify."""
        steps, last, every, _ = self._clock(batch_size)
        return steps - last >= every

    def probe_wanted(self, batch_size: int) -> bool:
        """Whether a probe is due at this batch size and the last decision's drafts were good
        enough for one (a step that skips drafting should draft instead)."""
        return self.last_promising and self.probe_due(batch_size)

    def probe_outcome(self, batch_size: int, accepted: int) -> None:
        """The probe just run at ``batch_size`` accepted ``accepted`` drafts: at least half of
        :attr:`last_probe_predicted` grows the bucket's probes, less resets them."""
        clock = self._clock(batch_size)
        if accepted >= 0.5 * self.last_probe_predicted:
            clock[2] = max(clock[2] // 2, self.probe_every_min)
            clock[3] = min(2 * clock[3], self.widths[-1])
        else:
            clock[2], clock[3] = self.probe_every, 1

    def forget_acceptance(self, keep: float = 0.5) -> None:
        """The history changed (new epoch, imported history, new weights): keep ``keep`` of
        the calibration's evidence (:meth:`AcceptanceCalibration.forget`)."""
        self._calibration.forget(keep)

    def calibration_at_bound(self):
        """The prediction levels whose calibration sits at its floor."""
        return self._calibration.at_bound()

    def seed(self, table: Mapping[Tuple[int, int], float],
             rows: Optional[Mapping[Tuple[int, int], float]] = None,
             context: Optional[Tuple[float, float]] = None) -> int:
        """Prior step costs from an earlier engine (:meth:`StepCostTable.seed`)."""
        return self.steps.seed(table, rows, context)

    def context_coefficients(self) -> Tuple[float, float]:
        """``(c_keys, c_rows)``: seconds per context token and per draft row x context token
        (:class:`rhyme_sglang.core.context_fit.ContextFit`)."""
        return self.steps.context.coefficients()

    def table(self) -> Dict[Tuple[int, int], float]:
        """``{(bucket, width): seconds}`` of each cell, the form :meth:`seed` takes."""
        return self.steps.table()

    def rows_table(self) -> Dict[Tuple[int, int], float]:
        """``{(bucket, width): forward rows per request}`` of each cell."""
        return self.steps.rows_table()

    def step_time(self, batch_size: int, width: int, keys: float = 0.0) -> Optional[float]:
        """Measured seconds of a step (None when its bucket never ran that width), at a batch
        context of ``keys`` tokens (every request verifying ``width`` rows; 0: context-free)."""
        return self.steps.step_time(batch_size, width, keys, width * keys)

    def estimate(self, batch_size: int, width: int, keys: float = 0.0) -> Optional[float]:
        """Measured seconds of a step, else the tokens-per-forward curve's estimate (at a
        batch context of ``keys``, as :meth:`step_time`)."""
        return self.steps.estimate(batch_size, width, keys, width * keys)

    def step_time_rows(self, batch_size: int, extra: int, keys: float = 0.0,
                       row_keys: float = 0.0) -> Optional[float]:
        """Seconds of a step whose forward runs ``extra`` draft rows beyond its last tokens
        (:meth:`StepCostTable.step_time_rows`)."""
        return self.steps.step_time_rows(batch_size, extra, keys, row_keys)

    def observe_acceptance(self, predicted: float, accepted: int,
                           level: Optional[float] = None) -> None:
        """Calibrate the store's acceptance estimate against one request's verify: the
        verified nodes' ``predicted`` accepted drafts, ``accepted`` taken, filed under the
        prediction the decision was calibrated at (``level``: the whole draft's; default
        ``predicted``; :class:`rhyme_sglang.core.calibration.AcceptanceCalibration`)."""
        self._calibration.observe(predicted, accepted, level)

    def calibrated(self, predicted: float) -> float:
        """Expected accepted drafts of one request whose drafts the store predicts
        ``predicted`` accepted, calibrated by its prediction level."""
        return self._calibration.calibrated(predicted)

    def batch_expected(self, per_request, factors: Optional[Sequence[float]] = None
                       ) -> Dict[int, float]:
        """``{width: the batch's calibrated expected accepted drafts}`` from each request's
        ``{width: predicted}`` (:func:`rhyme_sglang.core.draft.expected_accepts`), each
        request's times its ``factors[i]`` when given (its own evidence); pass it to
        :meth:`choose_width` with ``calibrated=True``."""
        out = {w: 0.0 for w in self.widths}
        for i, request in enumerate(per_request):
            factor = 1.0 if factors is None else factors[i]
            for w, predicted in request.items():
                if w in out:
                    out[w] += self.calibrated(predicted) * factor
        return out

    def critical_expected(self, per_request, horizon: Horizon,
                          factors: Optional[Sequence[float]] = None) -> Dict[int, float]:
        """``{width: calibrated expected accepted drafts}``, the mean over ``horizon``'s
        critical requests (``per_request`` and ``factors`` as for :meth:`batch_expected`,
        sequences in batch order); pass it to :meth:`choose_width` as ``critical``."""
        critical = horizon.critical()
        out = {w: 0.0 for w in self.widths}
        for i in critical:
            factor = 1.0 if factors is None else factors[i]
            for w, predicted in per_request[i].items():
                if w in out:
                    out[w] += self.calibrated(predicted) * factor / len(critical)
        return out

    # ------------------------------------------------------------------ decision
    def rates(self, batch_size: int, expected: Mapping[int, float], calibrated: bool = False,
              horizon: Optional[Horizon] = None,
              critical: Optional[Mapping[int, float]] = None,
              keys: float = 0.0) -> Dict[int, Optional[float]]:
        """Expected (useful, with a ``horizon``) tokens per second of each candidate width
        (None: nothing to estimate from), at a batch context of ``keys`` tokens."""
        out = {}
        scale = 1.0 if calibrated else self.calibration
        for w in self.candidates:
            seconds = self.estimate(batch_size, w, keys)
            gain = 0.0 if w == PLAIN else scale * float(expected.get(w, 0.0))
            tokens = batch_size + gain
            if horizon is not None:
                crit = 0.0 if w == PLAIN else scale * float((critical or {}).get(w, 0.0))
                tokens = horizon.useful(tokens, crit)
            out[w] = None if not seconds else tokens / seconds
        return out

    def choose_width(self, batch_size: int, expected: Mapping[int, float],
                     calibrated: bool = False, horizon: Optional[Horizon] = None,
                     critical: Optional[Mapping[int, float]] = None,
                     contexts: Optional[Sequence[int]] = None,
                     raw: Optional[Mapping[int, float]] = None) -> int:
        """The width for one decode step: 0 (plain) or a verify width.

        ``expected[w]``: the batch's summed expected accepted draft tokens when each request
        verifies its ``w`` most probable draft nodes (missing widths count as 0): the store's
        predictions (scaled here by the overall calibration), or already calibrated per
        request (:meth:`batch_expected`) with ``calibrated=True``. With a ``horizon``, rates
        count useful tokens only (module docstring); ``critical[w]``: the critical requests'
        mean expected accepted drafts, in the same form as ``expected`` (missing = none
        accepted; :meth:`critical_expected` gives the calibrated form). ``contexts``: each
        request's context tokens, which price the step's attention (unknown: its cells as
        measured). ``raw``: ``expected`` at face value (the store's predictions, no
        calibration), for probes (module docstring)."""
        if horizon is not None and len(horizon.remaining) != batch_size:
            raise ValueError(f"horizon has {len(horizon.remaining)} requests, batch has {batch_size}")
        self._decisions += 1
        self.tick(batch_size)
        self.last_advantage, self.last_reason, self.last_promising = 0.0, "best", False
        useful = [w for w in self.widths if expected.get(w, 0.0) > 0.0]
        if not useful:
            return PLAIN
        bucket = bucket_of(batch_size)
        if not self.steps.baseline_measured(batch_size):
            self.last_advantage, self.last_reason = None, "baseline"
            return PLAIN  # measure the baseline at this batch size first (a seeded one too)
        keys = _keys(contexts, batch_size)
        rates = self.rates(batch_size, expected, calibrated, horizon, critical, keys=keys)
        plain_rate = rates[PLAIN]
        self.last_advantage = max((rates[w] or 0.0) for w in useful) / plain_rate
        estimated, known = self._estimated_and_known(batch_size, {w: rates[w] for w in useful})
        best_known = max([plain_rate] + list(known.values()))
        for w in sorted(useful, key=lambda w: -(rates[w] or float("inf"))):
            if w not in known and (rates[w] is None or rates[w] >= self.explore_within * best_known):
                self.last_reason = "explore"
                return w  # explore a promising cell once
        scored = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                        reverse=True)
        ranking = [w for _, w in scored] + [PLAIN]
        choice = self._maybe_reexplore(bucket, ranking[0], {PLAIN: plain_rate, **estimated})
        self.last_promising = raw is not None and max(raw.values(), default=0.0) >= self.probe_tokens
        if (choice == PLAIN and self.last_reason == "best" and self.last_promising
                and self.probe_due(batch_size)):
            self.last_reason = "probe"
            width = self._probe_width(batch_size, raw)
            self.last_probe_predicted = float(raw.get(width, 0.0))
            return width
        return choice

    def choose_rows(self, batch_size: int, gains: Sequence[Sequence[float]],
                    horizon: Optional[Horizon] = None,
                    contexts: Optional[Sequence[int]] = None,
                    raw: Optional[Sequence[Sequence[float]]] = None):
        """Per-request verify widths for one decode step (a ragged verify): ``(width,
        counts)``, where ``counts[i]`` draft nodes of request ``i`` are verified (0: only its
        last token, as in a plain step) and ``width``, the step's cell, is the smallest of
        :attr:`widths` that holds the largest count (0 with every count 0: a plain step).

        ``gains[i]``: request ``i``'s expected acceptance of each of its draft nodes in
        best-first order (calibrated path probabilities, non-increasing). Under each width
        cap the step takes the nodes with the largest gains across the batch, as many as
        maximise ``(batch_size + their summed gain) / step_time_rows(batch_size, taken)``:
        a request with worthless drafts adds no rows, one with confident drafts adds many.
        With a ``horizon`` the numerator is the step's useful tokens (module docstring), and
        the nodes are also tried critical requests first, so a step may verify only the long
        requests' drafts. The rules of :meth:`choose_width` hold per cell: plain is measured
        first, a cell never measured at this bucket is tried once when its estimate is within
        ``explore_within`` of the best known rate, and every ``reexplore_every`` decisions the
        stalest other cell is run (the plain step, or the best allocation of that cell).
        ``contexts``: each request's context tokens; a draft row then costs the table's row
        plus its request's context times the fitted cost of a row's key (so the nodes of a
        long request cost more than those of a short one). ``raw``: ``gains`` at face value
        (the store's path probabilities, no calibration), for probes (module docstring)."""
        self._decisions += 1
        self.tick(batch_size)
        bs = batch_size
        if len(gains) != bs:
            raise ValueError(f"need one gain list per request ({bs}), got {len(gains)}")
        if horizon is not None and len(horizon.remaining) != bs:
            raise ValueError(f"horizon has {len(horizon.remaining)} requests, batch has {bs}")
        plain = (PLAIN, [0] * bs)
        bucket = bucket_of(bs)
        self.last_advantage, self.last_reason, self.last_promising = 0.0, "best", False
        if not any(len(g) and g[0] > 0 for g in gains):
            return plain
        if not self.steps.baseline_measured(bs):
            self.last_advantage, self.last_reason = None, "baseline"
            return plain  # measure the baseline at this batch size first (a seeded one too)
        keys = _keys(contexts, bs)
        plain_rate = (bs if horizon is None else horizon.useful(bs, 0.0)) / self.estimate(bs, PLAIN, keys)
        best = self._allocations(bs, gains, horizon, contexts, keys)
        if best is None:
            return plain
        if best:
            self.last_advantage = max(r for r, _ in best.values()) / plain_rate
            estimated, known = self._estimated_and_known(bs, {w: r for w, (r, _) in best.items()})
            best_known = max([plain_rate] + list(known.values()))
            for w in sorted(best, key=lambda w: -best[w][0]):
                if w not in known and best[w][0] >= self.explore_within * best_known:
                    self.last_reason = "explore"
                    return w, best[w][1]  # explore a promising cell once
            ranking = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                             reverse=True)
            choice = ranking[0][1] if ranking else PLAIN
            choice = self._maybe_reexplore(bucket, choice, {PLAIN: plain_rate, **estimated})
            if choice != PLAIN:
                return choice, best[choice][1]
        self.last_promising = raw is not None and max(
            (sum(g) for g in raw), default=0.0) >= self.probe_tokens
        if self.last_reason == "best" and self.last_promising and self.probe_due(bs):
            counts, self.last_probe_predicted = self._probe_counts(bs, raw)
            if any(counts):
                self.last_reason = "probe"
                return next(w for w in self.widths if w >= max(counts)), counts
        return plain

    def _probe_cap(self, batch_size: int) -> int:
        """The most draft rows a probe verifies at this batch size (module docstring)."""
        return max(batch_size, self.widths[-1]) * self._clock(batch_size)[3]

    def _probe_counts(self, bs: int, raw):
        """``(counts, face-value expected accepted drafts)`` of a probe (module docstring):
        the batch's nodes with a face-value gain of at least ``probe_gain``, best first, at
        most :meth:`_probe_cap` (at least the best node)."""
        nodes = DraftNodes(raw, self.widths[-1])
        take = int(np.count_nonzero(nodes.gain >= self.probe_gain))
        take = min(max(take, 1), self._probe_cap(bs), len(nodes.gain))
        counts = np.bincount(nodes.request[:take], minlength=bs).tolist()
        return counts, float(nodes.gain[:take].sum())

    def _probe_width(self, bs: int, raw: Mapping[int, float]) -> int:
        """A batch-wide probe's width: the widest whose added nodes gain at least
        ``probe_gain`` each at face value, within :meth:`_probe_cap` rows."""
        width, gained = self.widths[0], 0.0
        for below, w in zip((0,) + self.widths, self.widths):
            added = float(raw.get(w, 0.0)) - gained
            if bs * w > self._probe_cap(bs) or added < self.probe_gain * bs * (w - below):
                break
            width, gained = w, float(raw.get(w, 0.0))
        return width

    def _allocations(self, bs: int, gains, horizon, contexts, keys: float):
        """``{cell width: (rate, counts)}``: under each width cap, the best-first draft nodes
        of the batch that maximise the step's rate (:meth:`choose_rows`); None when a step's
        time cannot be estimated."""
        nodes = DraftNodes(gains, self.widths[-1])
        times = self.steps.rows_times(bs, len(nodes.gain), keys)
        if None in times:
            return None
        times = np.asarray(times[1:])  # times[k - 1]: a step with k draft rows
        c_rows = self.steps.context.coefficients()[1] if contexts is not None else 0.0
        node_seconds = c_rows * np.asarray(contexts, dtype=np.float64)[nodes.request] if c_rows else None
        orders = [np.arange(len(nodes.gain))]
        is_critical = np.zeros(bs, dtype=bool)
        if horizon is not None:
            is_critical[list(horizon.critical())] = True
            if not is_critical.all():  # the long requests' nodes first
                first = is_critical[nodes.request]
                orders.append(np.concatenate([orders[0][first], orders[0][~first]]))
        deepest = int(nodes.rank.max())
        best: Dict[int, tuple] = {}  # cell width -> (rate, counts)
        for order in orders:
            for cap, below in zip(self.widths, (0,) + self.widths):
                if below > deepest:
                    break  # no node ranks this deep: the same nodes as the last cap
                under = order if cap > deepest else order[nodes.rank[order] < cap]
                step_times = times if node_seconds is None else (
                    times[: len(under)] + np.cumsum(node_seconds[under]))
                top_rate, top_k = best_prefix(bs, nodes.gain[under], nodes.request[under],
                                              step_times, horizon, is_critical)
                if top_k:
                    counts = np.bincount(nodes.request[under[:top_k]], minlength=bs).tolist()
                    width = next(w for w in self.widths if w >= max(counts))
                    if width not in best or top_rate > best[width][0]:
                        best[width] = (top_rate, counts)
        return best

    def predict(self, batch_size: int, gains: Sequence[Sequence[float]], counts: Sequence[int],
                contexts: Optional[Sequence[int]] = None) -> Tuple[float, Optional[float]]:
        """``(expected accepted drafts, estimated seconds)`` of a step verifying ``counts[i]``
        of request ``i``'s best-first draft nodes (all 0: a plain step), for logs that set
        decisions against outcomes."""
        keys = _keys(contexts, batch_size)
        gain = float(sum(sum(g[:c]) for g, c in zip(gains, counts)))
        rows = int(sum(counts))
        if rows == 0:
            return 0.0, self.estimate(batch_size, PLAIN, keys)
        row_keys = float(sum(c * x for c, x in zip(counts, contexts))) if contexts is not None else 0.0
        return gain, self.steps.step_time_rows(batch_size, rows, keys, row_keys)

    def _estimated_and_known(self, batch_size: int, rates: Mapping[int, float]):
        """``(estimated, known)``: the widths of ``rates`` whose cell at this batch size has a
        cost (seeded or measured), and of those the ones this model ran (:meth:`_measured_here`)."""
        bucket = bucket_of(batch_size)
        estimated = {w: r for w, r in rates.items() if self.step_time(batch_size, w) is not None}
        return estimated, {w: r for w, r in estimated.items() if self._measured_here(bucket, w)}

    def _measured_here(self, bucket: int, width: int) -> bool:
        """Whether this model ran the cell. A seeded cell (another engine's measurement) is an
        estimate until then: tried once when promising, like a cell never run (stop 42: a
        batch-1 width-8 cell saved by a long-context rollout read 47 ms against 25 ms plain
        steps, and ``bench_serving``'s short chats ran plain where a width-8 verify took 37 ms
        in the stop before; resting drafting slowed the re-exploration clock)."""
        return self.steps.measured_at((bucket, width)) >= 0

    def _maybe_reexplore(self, bucket: int, choice: int, rates: Mapping[int, float]) -> int:
        """``choice``, except every ``reexplore_every`` decisions: the stalest other cell
        (never observed here = stalest; ties: the plain baseline, then the best rate) among
        the plain step, the verify cells whose rate is within ``explore_within`` of the best,
        and seeded cells this model never measured. A measured cell far behind is not re-run:
        on a 2-core CPU a batch-27 verify at width 16 took 2.2 s against 0.3 s for a plain
        step, and one such refresh per 64 steps costs ~10% of the decode time. A cell that only
        looks slow is bounded by ``max_jump`` per measurement, so one stall does not push it
        out of reach. A seeded cell is run once however slow it reads: seeds come from earlier
        engines, whose kernels may have been slower (stop 35: verify cells saved with one
        kernel thread read 2-3x a plain step where a verify now costs 1.5x, and were never
        run again)."""
        plain_rate, rate = rates.get(PLAIN), rates.get(choice)
        if (choice != PLAIN and plain_rate and rate and rate < self.close_call * plain_rate
                and self._decisions - self.steps.measured_at((bucket, PLAIN)) >= self.close_refresh):
            self.last_reason = "close_call"
            return PLAIN  # a close call: the baseline it hangs on is re-measured often
        if self._decisions % self.reexplore_every or len(rates) < 2:
            return choice
        best = max(r or 0.0 for r in rates.values())
        alternatives = [w for w, r in rates.items() if w != choice
                        and (w == PLAIN or (r or 0.0) >= self.explore_within * best
                             or self.steps.measured_at((bucket, w)) < 0)]
        if not alternatives:
            return choice
        self.last_reason = "reexplore"
        return min(alternatives, key=lambda w: (self.steps.measured_at((bucket, w)), w != PLAIN,
                                                -(rates[w] or 0.0)))

    def as_dict(self) -> dict:
        return {
            "calibration": self.calibration,
            # one request's predicted accepted drafts -> factor
            "calibration_by_prediction": self._calibration.by_level(),
            "widths": list(self.widths),
            **self.steps.as_dict(self.candidates),
        }


def _keys(contexts: Optional[Sequence[int]], batch_size: int) -> float:
    """A batch's context tokens (0 when unknown)."""
    if contexts is None:
        return 0.0
    if len(contexts) != batch_size:
        raise ValueError(f"need one context per request ({batch_size}), got {len(contexts)}")
    return float(sum(contexts))
