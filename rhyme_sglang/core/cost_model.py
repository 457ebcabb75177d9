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
(:mod:`rhyme_sglang.core.calibration`). :meth:`SpecCostModel.decide` picks the width with
the most expected tokens per second::

    rate(w) = (bs + calibration * expected[w]) / seconds(bs, w)

A cell never measured is estimated from a curve of seconds vs tokens per forward fitted over
every measured cell (linear interpolation; beyond the last point, proportional). Unmeasured
cells are tried once when their estimate is within ``explore_within`` of the best known rate.

Per-request widths (a ragged verify, ``decide(gains=...)``) take, from every
draft node of the batch, the most probable ones, as many as maximise::

    rate(K) = (bs + sum of the K largest calibrated node probabilities) / seconds(bs, K rows)

with ``seconds(bs, K)`` piecewise linear in the step's draft rows through the bucket's plain
cell and its verify cells; each cell also keeps (as an EMA) the tokens its steps' forwards ran,
so a cell stands for the ragged steps it measured. Its cell is the smallest width that holds
the step's largest request.

Probes (:mod:`rhyme_sglang.core.probes`): where a bucket ran no verify for a while and the
drafts look good at face value, a verify runs whatever the table says, so a wrong table is
re-measured.

A step's useful tokens can be capped by the rollout's critical path (a
:class:`rhyme_sglang.core.horizon.Horizon`, optional; see that module).

The table must not be poisoned by one bad step, because a cell that looks slow is never
chosen again and so never corrected. So:

* a measurement moves a cell at most ``max_jump`` times its current value (a one-off stall
  cannot multiply a cell by 10; a lasting change still gets there in a few steps);
* every ``reexplore_every`` decisions the stalest alternative of the bucket (the measured
  cell this model observed longest ago, or never: seeded cells count as never) is chosen
  instead of the best, so every competitive cell is refreshed, the plain baseline always
  (a verify cell whose rate is under ``explore_within`` of the best is not: re-running it
  costs a slow step, and ``max_jump`` keeps one stall from pushing a cell that far);
* a verify is judged against plain steps this model measured at the batch size, or within
  ``baseline_near`` of it (a plain step is run first where there are none), never against a
  cell extrapolated from other sizes, and where a verify wins by less than ``close_call``
  the bucket's plain step is re-run every ``close_refresh`` decisions; a seeded cell is a
  prior that its first measurement replaces.

Every decision comes back as a :class:`Decision` (:meth:`SpecCostModel.decide`); the model
keeps no "last decision" state. Calibration (the shared factor by prediction level, times a
request's own evidence) is applied here only: :meth:`SpecCostModel.node_gains`,
:meth:`SpecCostModel.batch_expected`, :meth:`SpecCostModel.expected_at`.

Standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from rhyme_sglang.core.calibration import PRIOR_VERIFIES, AcceptanceCalibration
from rhyme_sglang.core.decision import Decision
from rhyme_sglang.core.horizon import Horizon
from rhyme_sglang.core.node_search import DraftNodes, best_prefix
from rhyme_sglang.core.probes import ProbeClock, probe_counts, probe_width
from rhyme_sglang.core.step_table import PLAIN, StepCostTable, bucket_of

__all__ = ["PLAIN", "Decision", "SpecCostModel", "bucket_of", "check_widths", "default_widths"]


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
    probe_every: int = 32  # a bucket's decode steps without a verify before a probe (core/probes.py)
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
    probes: ProbeClock = field(init=False, repr=False)  # per bucket: when a probe is due

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
        self.probes = ProbeClock(self.probe_every, self.probe_every_min, self.widths[-1])
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
            self.probes.verified(batch_size)

    # ------------------------------------------------------------------ probes

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
        :meth:`decide` with ``calibrated=True``."""
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
        sequences in batch order); pass it to :meth:`decide` as ``critical``."""
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
            if horizon is None:
                tokens = batch_size + gain
            else:  # the foreground's tokens (``expected`` leaves background requests out)
                crit = 0.0 if w == PLAIN else scale * float((critical or {}).get(w, 0.0))
                tokens = horizon.useful(horizon.rows(batch_size) + gain, crit)
            out[w] = None if not seconds else tokens / seconds
        return out


    def node_gains(self, probs: Sequence[float], factor: float = 1.0) -> List[float]:
        """Calibrated expected acceptance of each of one request's draft nodes from their path
        probabilities ``probs`` (best-first): the calibration's at the whole draft's level,
        times ``factor`` (the request's own evidence, :class:`RequestEvidence`)."""
        predicted = sum(probs)
        if predicted <= 0:
            return []
        scale = self.calibrated(predicted) / predicted * factor
        return [p * scale for p in probs]

    def expected_at(self, predicted: float, level: float) -> float:
        """Calibrated expected accepted drafts of verified nodes the store predicts
        ``predicted`` accepted, from a draft whose whole prediction was ``level``."""
        return predicted and predicted * (self.calibrated(level) / level)

    def decide(self, batch_size: int, *, gains: Optional[Sequence[Sequence[float]]] = None,
               expected: Optional[Mapping[int, float]] = None, calibrated: bool = False,
               critical: Optional[Mapping[int, float]] = None,
               horizon: Optional[Horizon] = None, contexts: Optional[Sequence[int]] = None,
               raw=None) -> Decision:
        """The decision for one decode step of ``batch_size`` requests; give exactly one of:

        * ``gains`` (a ragged verify): ``gains[i]``, request ``i``'s expected acceptance of
          each of its draft nodes in best-first order (:meth:`node_gains`, non-increasing).
          Under each width cap the step takes the nodes with the largest gains across the
          batch, as many as maximise ``(batch_size + their summed gain) /
          step_time_rows(batch_size, taken)``: a request with worthless drafts adds no rows.
          The decision's ``counts[i]`` nodes of request ``i`` are verified (0: only its last
          token) and ``width``, its cell, is the smallest width that holds the largest count.
          With a ``horizon`` the nodes are also tried critical requests first.
        * ``expected`` (one width for the batch): ``expected[w]``, the batch's summed expected
          accepted drafts when each request verifies its ``w`` best nodes (missing widths: 0),
          the store's predictions scaled here by the overall calibration, or already calibrated
          (:meth:`batch_expected`) with ``calibrated=True``; ``critical[w]``: the critical
          requests' mean, in the same form (:meth:`critical_expected`).

        ``horizon``: rates count useful tokens only (module docstring), and its background
        requests' drafts are not verified (``expected`` and ``critical`` must leave them out:
        :meth:`batch_expected` with a factor of 0). ``contexts``: each
        request's context tokens, which price the step's attention (unknown: its cells as
        measured). ``raw``: ``gains`` (per request) or ``expected`` (per width) at face value,
        no calibration, for probes (:mod:`rhyme_sglang.core.probes`). Plain is measured first
        at each batch size; a cell never run here is tried once when its estimate is within
        ``explore_within`` of the best known rate; the re-exploration rules of the module
        docstring hold per cell. Counts the step on the probe clock."""
        if (gains is None) == (expected is None):
            raise ValueError("decide needs exactly one of gains (per request) or expected (per width)")
        if horizon is not None and len(horizon.remaining) != batch_size:
            raise ValueError(f"horizon has {len(horizon.remaining)} requests, batch has {batch_size}")
        if gains is not None and len(gains) != batch_size:
            raise ValueError(f"need one gain list per request ({batch_size}), got {len(gains)}")
        self._decisions += 1
        self.probes.tick(batch_size)
        if gains is not None:
            return self._decide_rows(batch_size, gains, horizon, contexts, raw)
        return self._decide_width(batch_size, expected, calibrated, horizon, critical,
                                  contexts, raw)

    def _decide_width(self, bs: int, expected, calibrated, horizon, critical, contexts,
                      raw) -> Decision:
        useful = [w for w in self.widths if expected.get(w, 0.0) > 0.0]
        if not useful:
            return Decision(PLAIN)
        if not self.steps.baseline_measured(bs):
            return Decision(PLAIN, reason="baseline", advantage=None)
        rates = self.rates(bs, expected, calibrated, horizon, critical, keys=_keys(contexts, bs))
        plain_rate = rates[PLAIN]
        advantage = max((rates[w] or 0.0) for w in useful) / plain_rate
        choice, reason = self._pick(bs, {w: rates[w] for w in useful}, plain_rate)
        if reason == "explore":
            return Decision(choice, None, reason, advantage)
        promising = raw is not None and max(raw.values(), default=0.0) >= self.probe_tokens
        if choice == PLAIN and reason == "best" and promising and self.probes.due(bs):
            width = probe_width(bs, raw, self.widths, self.probe_gain, self.probes.cap(bs))
            return Decision(width, None, "probe", advantage, promising, float(raw.get(width, 0.0)))
        return Decision(choice, None, reason, advantage, promising)

    def _decide_rows(self, bs: int, gains, horizon, contexts, raw) -> Decision:
        plain = [0] * bs
        if horizon is not None and horizon.background:  # background drafts are not verified
            gains = [g if horizon.foreground(i) else [] for i, g in enumerate(gains)]
            if raw is not None:
                raw = [g if horizon.foreground(i) else [] for i, g in enumerate(raw)]
        if not any(len(g) and g[0] > 0 for g in gains):
            return Decision(PLAIN, plain)
        if not self.steps.baseline_measured(bs):
            return Decision(PLAIN, plain, "baseline", None)
        keys = _keys(contexts, bs)
        plain_rate = (bs if horizon is None else horizon.useful(horizon.rows(bs), 0.0)
                      ) / self.estimate(bs, PLAIN, keys)
        best = self._allocations(bs, gains, horizon, contexts, keys)
        if best is None:
            return Decision(PLAIN, plain)
        advantage, reason = 0.0, "best"
        if best:
            advantage = max(r for r, _ in best.values()) / plain_rate
            choice, reason = self._pick(bs, {w: r for w, (r, _) in best.items()}, plain_rate)
            if choice != PLAIN:
                return Decision(choice, best[choice][1], reason, advantage)
        promising = raw is not None and max((sum(g) for g in raw), default=0.0) >= self.probe_tokens
        if reason == "best" and promising and self.probes.due(bs):
            counts, predicted = probe_counts(bs, raw, self.widths, self.probe_gain,
                                             self.probes.cap(bs))
            if any(counts):
                width = next(w for w in self.widths if w >= max(counts))
                return Decision(width, counts, "probe", advantage, promising, predicted)
        return Decision(PLAIN, plain, reason, advantage, promising)

    def _pick(self, batch_size: int, rates: Mapping[int, Optional[float]], plain_rate: float):
        """``(width, reason)`` among the verify cells' ``rates`` and plain: a promising cell
        never run here once ("explore"), else the best known beating ``margin`` times plain
        ("best"), with :meth:`_maybe_reexplore`'s exceptions."""
        estimated, known = self._estimated_and_known(batch_size, rates)
        best_known = max([plain_rate] + list(known.values()))
        for w in sorted(rates, key=lambda w: -(rates[w] or float("inf"))):
            if w not in known and (rates[w] is None or rates[w] >= self.explore_within * best_known):
                return w, "explore"
        scored = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                        reverse=True)
        choice = scored[0][1] if scored else PLAIN
        return self._maybe_reexplore(bucket_of(batch_size), choice, {PLAIN: plain_rate, **estimated})

    def _allocations(self, bs: int, gains, horizon, contexts, keys: float):
        """``{cell width: (rate, counts)}``: under each width cap, the best-first draft nodes
        of the batch that maximise the step's rate (:meth:`decide`); None when a step's
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
        estimate until then: tried once when promising, like a cell never run."""
        return self.steps.measured_at((bucket, width)) >= 0

    def _maybe_reexplore(self, bucket: int, choice: int, rates: Mapping[int, float]):
        """``(choice, "best")``, except for a close call (a verify winning by less than
        ``close_call`` whose bucket ran no plain step for ``close_refresh`` decisions: plain,
        "close_call") and every ``reexplore_every`` decisions: the stalest other cell
        ("reexplore"; never observed here = stalest; ties: the plain baseline, then the best
        rate) among the plain step, the verify cells whose rate is within ``explore_within``
        of the best, and seeded cells this model never measured. A measured cell far behind
        is not re-run (one slow verify per ``reexplore_every`` steps can cost ~10% of the
        decode time); a cell that only looks slow is bounded by ``max_jump`` per measurement,
        so one stall does not push it out of reach. A seeded cell is run once however slow it
        reads: seeds come from earlier engines, whose kernels may have been slower."""
        plain_rate, rate = rates.get(PLAIN), rates.get(choice)
        if (choice != PLAIN and plain_rate and rate and rate < self.close_call * plain_rate
                and self._decisions - self.steps.measured_at((bucket, PLAIN)) >= self.close_refresh):
            return PLAIN, "close_call"  # the baseline it hangs on is re-measured often
        if self._decisions % self.reexplore_every or len(rates) < 2:
            return choice, "best"
        best = max(r or 0.0 for r in rates.values())
        alternatives = [w for w, r in rates.items() if w != choice
                        and (w == PLAIN or (r or 0.0) >= self.explore_within * best
                             or self.steps.measured_at((bucket, w)) < 0)]
        if not alternatives:
            return choice, "best"
        return min(alternatives, key=lambda w: (self.steps.measured_at((bucket, w)), w != PLAIN,
                                                -(rates[w] or 0.0))), "reexplore"


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
