"""Per-step verify width from measured step costs: plain decode or a width from a small set.

For a decode step of ``bs`` requests the engine can run a plain decode (width 0: ``bs`` tokens
in, ``bs`` out) or verify ``w`` draft tokens per request (``bs * (w + 1)`` tokens in,
``bs + accepted`` out). :class:`SpecCostModel` keeps the measured seconds of whole steps per
(power-of-two batch bucket, width), with the batch size they were measured at (both as
exponential moving averages), reads a width's cost at any batch size piecewise linearly
between its cells (a step costs a fixed part plus a part per token, so seconds per request
fall with batch size: a cell measured at 17 requests overstates 32 requests' cost when scaled
per request), and a calibration factor between the draft store's predicted acceptance (sums of draft path
probabilities) and what verification accepted. :meth:`SpecCostModel.choose_width` returns the
width with the most expected tokens per second::

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

import bisect
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from rhyme_sglang.core.calibration import AcceptanceCalibration
from rhyme_sglang.core.horizon import Horizon
from rhyme_sglang.core.node_search import DraftNodes, best_prefix

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
    calibration_decay: float = 0.02  # weight of one request's verify in the calibration's sums
    calibration_prior: float = 1.0  # predicted tokens' worth of the overall calibration per level
    max_jump: float = 2.0  # one measurement moves a cell by at most this factor
    baseline_near: float = 0.1  # plain measured within this fraction of a batch size (>= 1 request)
    close_call: float = 1.25  # a verify winning by less than this factor over plain ...
    close_refresh: int = 8  # ... re-measures plain when the bucket ran none for this many decisions
    # (bucket, width) -> [seconds of a whole step, batch size], both EMAs of what was measured
    _cell: Dict[Tuple[int, int], list] = field(default_factory=dict)
    _seen: Dict[Tuple[int, int], int] = field(default_factory=dict)  # cell -> decision it was measured at
    _decisions: int = 0
    _calibration: AcceptanceCalibration = field(init=False)
    _curve: Optional[list] = None  # (tokens per forward, seconds) of every cell; None = stale
    _by_width: Dict[int, list] = field(default_factory=dict)  # width -> sorted points; {} = stale
    # batch size -> seconds of a plain step at exactly that size (EMA), measured by this model;
    # the baseline a verify is judged against, read near the decided size (baseline_near)
    _plain: Dict[int, float] = field(default_factory=dict)
    _plain_sizes: list = field(default_factory=list)  # sorted keys of _plain
    # the last decision's best verify rate over the plain rate (0: no verify had a gain;
    # None: plain was chosen to measure it); the worker skips drafting after clear losses
    last_advantage: Optional[float] = None

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

    @property
    def calibration(self) -> float:
        """Accepted over predicted drafts, over recent request verifies (all levels)."""
        return self._calibration.factor

    @property
    def candidates(self) -> Tuple[int, ...]:
        return (PLAIN,) + self.widths

    # ------------------------------------------------------------------ measurements
    def observe_step(self, batch_size: int, width: int, seconds: float,
                     rows: Optional[int] = None) -> None:
        """Record the wall time of one whole step of ``batch_size`` requests at ``width``.

        ``rows``: tokens the step's forward ran, when a ragged verify ran fewer than
        ``batch_size * (width + 1)`` (requests verifying fewer nodes than ``width``); its
        cell is then that of the step's largest request width (see :meth:`choose_rows`)."""
        if width != PLAIN and width not in self.widths:
            raise ValueError(f"width must be 0 (plain) or one of {self.widths}, got {width!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        full = batch_size * (width + 1)
        if rows is None:
            rows = full
        if not batch_size <= rows <= full:
            raise ValueError(f"rows must be in [{batch_size}, {full}] for {batch_size} requests "
                             f"at width {width}, got {rows!r}")
        if width == PLAIN:
            self._observe_plain(batch_size, seconds)
        key = (bucket_of(batch_size), width)
        cell = self._cell.get(key)
        if cell is None or key not in self._seen:  # a seeded prior gives way to the first measurement
            self._cell[key] = [seconds, float(batch_size), float(rows)]
        else:
            old = self._at(cell, batch_size, width)  # the cell's estimate at this batch size
            seconds = self._bounded(seconds, old)
            cell[0] = (1 - self.alpha) * cell[0] + self.alpha * seconds
            cell[1] = (1 - self.alpha) * cell[1] + self.alpha * batch_size
            cell[2] = (1 - self.alpha) * cell[2] + self.alpha * rows
        self._seen[key] = self._decisions
        self._stale()

    def _bounded(self, seconds: float, old: float) -> float:
        """A measurement moves an estimate at most ``max_jump`` times its current value."""
        return min(max(seconds, old / self.max_jump), old * self.max_jump)

    def _observe_plain(self, batch_size: int, seconds: float) -> None:
        old = self._plain.get(batch_size)
        if old is None:
            bisect.insort(self._plain_sizes, batch_size)
            self._plain[batch_size] = seconds
            return
        seconds = self._bounded(seconds, old)
        self._plain[batch_size] = (1 - self.alpha) * old + self.alpha * seconds

    def _near_plain(self, batch_size: int) -> Optional[float]:
        """A plain step's seconds at ``batch_size`` from this model's plain steps at sizes
        within ``baseline_near`` of it (at least one request): the exact size, else linear
        between the nearest measured sizes on each side, else the nearest one scaled along its
        bucket's cell. None when no plain step was measured that near.

        Why not the cells alone: a cell is an EMA of (batch size, seconds) over every step of
        its bucket, and its reading at another size is extrapolated. At batch 16 a plain cell
        measured at 11.8 requests (the steps while a round's prefills were still joining) read
        56.7 ms against 42-44 ms measured at 16, and width-1 verifies (51 ms) looked cheaper
        than plain steps for a whole round (stop 39, bench_serving)."""
        exact = self._plain.get(batch_size)
        if exact is not None:
            return exact
        reach = max(1.0, self.baseline_near * batch_size)
        sizes = self._plain_sizes
        i = bisect.bisect_left(sizes, batch_size)
        lo = sizes[i - 1] if i > 0 and batch_size - sizes[i - 1] <= reach else None
        hi = sizes[i] if i < len(sizes) and sizes[i] - batch_size <= reach else None
        if lo is not None and hi is not None:
            y0, y1 = self._plain[lo], self._plain[hi]
            return y0 + (y1 - y0) * (batch_size - lo) / (hi - lo)
        near = lo if lo is not None else hi
        if near is None:
            return None
        cell = self._cell.get((bucket_of(batch_size), PLAIN))
        if cell is None:
            return self._plain[near] * batch_size / near
        return self._plain[near] * self._at(cell, batch_size, PLAIN) / max(
            self._at(cell, near, PLAIN), 1e-12)

    def observe_acceptance(self, predicted: float, accepted: int) -> None:
        """Calibrate the store's acceptance estimate against one request's verify
        (:class:`rhyme_sglang.core.calibration.AcceptanceCalibration`)."""
        self._calibration.observe(predicted, accepted)

    def calibrated(self, predicted: float) -> float:
        """Expected accepted drafts of one request whose drafts the store predicts
        ``predicted`` accepted, calibrated by its prediction level."""
        return self._calibration.calibrated(predicted)

    def batch_expected(self, per_request) -> Dict[int, float]:
        """``{width: the batch's calibrated expected accepted drafts}`` from each request's
        ``{width: predicted}`` (:func:`rhyme_sglang.core.draft.expected_accepts`); pass it to
        :meth:`choose_width` with ``calibrated=True``."""
        out = {w: 0.0 for w in self.widths}
        for request in per_request:
            for w, predicted in request.items():
                if w in out:
                    out[w] += self.calibrated(predicted)
        return out

    def critical_expected(self, per_request, horizon: Horizon) -> Dict[int, float]:
        """``{width: calibrated expected accepted drafts}``, the mean over ``horizon``'s
        critical requests (``per_request`` as for :meth:`batch_expected`, a sequence in batch
        order); pass it to :meth:`choose_width` as ``critical``."""
        critical = horizon.critical()
        out = {w: 0.0 for w in self.widths}
        for i in critical:
            for w, predicted in per_request[i].items():
                if w in out:
                    out[w] += self.calibrated(predicted) / len(critical)
        return out

    def seed(self, table: Mapping[Tuple[int, int], float],
             rows: Optional[Mapping[Tuple[int, int], float]] = None) -> int:
        """Prior step costs ``{(batch_size, width): seconds per whole step}``, as if measured
        (a cost table of another run or machine); later measurements move them. ``rows``:
        the forward rows per request each cell's steps ran (:meth:`rows_table`; a ragged
        verify cell ran fewer than ``width + 1``); a cell without one ran them all. Returns
        how many cells it took (widths this model does not use are skipped). Seeded cells
        count as never observed by this model: the stalest, refreshed first, replaced by
        their first measurement."""
        taken = 0
        for (batch_size, width), seconds in table.items():
            if width == PLAIN or width in self.widths:
                key = (bucket_of(batch_size), width)
                per_request = (rows or {}).get((batch_size, width), width + 1)
                per_request = min(max(float(per_request), 1.0), float(width + 1))
                self._cell[key] = [float(seconds), float(batch_size), batch_size * per_request]
                self._seen.pop(key, None)
                taken += 1
        self._stale()
        return taken

    def table(self) -> Dict[Tuple[int, int], float]:
        """Each measured cell's step seconds at its bucket's batch size, ``{(bucket, width):
        seconds}``: the form :meth:`seed` takes (a round trip gives the same model at every
        bucket size, with :meth:`rows_table` for ragged cells)."""
        return {(b, w): self.step_time(b, w) for (b, w) in self._cell}

    def rows_table(self) -> Dict[Tuple[int, int], float]:
        """Each cell's forward rows per request (EMA over its steps), ``{(bucket, width):
        rows}``: less than ``width + 1`` where ragged verifies ran fewer nodes. Without it a
        seeded ragged cell would stand for full-width steps and make rows look cheaper than
        they are (the next engine then over-verifies until it re-measures each cell)."""
        return {(b, w): cell[2] / cell[1] for (b, w), cell in self._cell.items()}

    # ------------------------------------------------------------------ estimates
    def _stale(self) -> None:
        """Forget the curves derived from the cells (after a cell changed)."""
        self._curve = None
        self._by_width.clear()

    def _points(self, width: int) -> list:
        """This width's measured (batch size, seconds) points, by batch size (rebuilt after a
        cell changes, not on every estimate of a decode step)."""
        points = self._by_width.get(width)
        if points is None:
            points = self._by_width[width] = sorted(
                (bs, sec) for (_, w), (sec, bs, _rows) in self._cell.items() if w == width)
        return points

    def _at(self, cell, batch_size: int, width: int) -> float:
        """Seconds of a ``width`` step at ``batch_size``, from the cells of that width:
        piecewise linear in batch size between their measured points (a cell measured while a
        batch was filling up, at 17 requests, is not taken for 32 requests' cost), extended
        past the ends along the nearest segment (never below proportional to zero); one point
        alone scales proportionally. ``cell`` is the one the batch size falls in."""
        points = self._points(width)
        if len(points) < 2:
            sec, bs = cell[0], cell[1]
            return sec * batch_size / bs
        if batch_size <= points[0][0]:
            (x0, y0), (x1, y1) = points[0], points[1]
        elif batch_size >= points[-1][0]:
            (x0, y0), (x1, y1) = points[-2], points[-1]
        else:
            for (x0, y0), (x1, y1) in zip(points, points[1:]):
                if batch_size <= x1:
                    break
        if x1 - x0 < 1e-9:
            return y1 * batch_size / x1
        y = y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)
        nearest_x, nearest_y = (x0, y0) if abs(batch_size - x0) < abs(batch_size - x1) else (x1, y1)
        return max(y, nearest_y * min(batch_size / nearest_x, 1.0), 1e-9)

    def step_time(self, batch_size: int, width: int) -> Optional[float]:
        """Estimated seconds of a whole step from this width's measurements (None when the
        batch size's bucket was never measured at that width)."""
        cell = self._cell.get((bucket_of(batch_size), width))
        if cell is None:
            return None
        near = self._near_plain(batch_size) if width == PLAIN else None
        return self._at(cell, batch_size, width) if near is None else near

    def _baseline_measured(self, batch_size: int) -> bool:
        """Whether this model ran plain steps in the batch size's bucket (a seeded cell is a
        prior, not a measurement) and within ``baseline_near`` of the size itself."""
        return ((bucket_of(batch_size), PLAIN) in self._seen
                and self._near_plain(batch_size) is not None)

    def estimate(self, batch_size: int, width: int) -> Optional[float]:
        """Measured seconds of a step, else the tokens-per-forward curve's estimate."""
        measured = self.step_time(batch_size, width)
        if measured is not None:
            return measured
        return self._curve_at(batch_size * (width + 1))

    def _curve_at(self, tokens: float) -> Optional[float]:
        """Seconds of a forward of ``tokens`` tokens on the curve over every measured cell
        (None when nothing was measured)."""
        if self._curve is None:  # rebuilt after a measurement, not per estimate
            self._curve = sorted({rows: sec for sec, _bs, rows in self._cell.values()}.items())
        points = self._curve
        if not points:
            return None
        if tokens <= points[0][0]:
            return points[0][1] * tokens / points[0][0] if len(points) == 1 else points[0][1]
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        t_last, s_last = points[-1]
        return s_last * tokens / t_last

    # ------------------------------------------------------------------ decision
    def rates(self, batch_size: int, expected: Mapping[int, float], calibrated: bool = False,
              horizon: Optional[Horizon] = None,
              critical: Optional[Mapping[int, float]] = None) -> Dict[int, Optional[float]]:
        """Expected (useful, with a ``horizon``) tokens per second of each candidate width
        (None: nothing to estimate from)."""
        out = {}
        scale = 1.0 if calibrated else self.calibration
        for w in self.candidates:
            seconds = self.estimate(batch_size, w)
            gain = 0.0 if w == PLAIN else scale * float(expected.get(w, 0.0))
            tokens = batch_size + gain
            if horizon is not None:
                crit = 0.0 if w == PLAIN else scale * float((critical or {}).get(w, 0.0))
                tokens = horizon.useful(tokens, crit)
            out[w] = None if not seconds else tokens / seconds
        return out

    def choose_width(self, batch_size: int, expected: Mapping[int, float],
                     calibrated: bool = False, horizon: Optional[Horizon] = None,
                     critical: Optional[Mapping[int, float]] = None) -> int:
        """The width for one decode step: 0 (plain) or a verify width.

        ``expected[w]``: the batch's summed expected accepted draft tokens when each request
        verifies its ``w`` most probable draft nodes (missing widths count as 0): the store's
        predictions (scaled here by the overall calibration), or already calibrated per
        request (:meth:`batch_expected`) with ``calibrated=True``. With a ``horizon``, rates
        count useful tokens only (module docstring); ``critical[w]``: the critical requests'
        mean expected accepted drafts, in the same form as ``expected`` (missing = none
        accepted; :meth:`critical_expected` gives the calibrated form)."""
        if horizon is not None and len(horizon.remaining) != batch_size:
            raise ValueError(f"horizon has {len(horizon.remaining)} requests, batch has {batch_size}")
        self._decisions += 1
        self.last_advantage = 0.0
        useful = [w for w in self.widths if expected.get(w, 0.0) > 0.0]
        if not useful:
            return PLAIN
        bucket = bucket_of(batch_size)
        if not self._baseline_measured(batch_size):
            self.last_advantage = None
            return PLAIN  # measure the baseline at this batch size first (a seeded one too)
        rates = self.rates(batch_size, expected, calibrated, horizon, critical)
        plain_rate = rates[PLAIN]
        self.last_advantage = max((rates[w] or 0.0) for w in useful) / plain_rate
        known = {w: rates[w] for w in useful if self.step_time(batch_size, w) is not None}
        best_known = max([plain_rate] + list(known.values()))
        for w in sorted(useful, key=lambda w: -(rates[w] or float("inf"))):
            if w not in known and (rates[w] is None or rates[w] >= self.explore_within * best_known):
                return w  # explore a promising cell once
        scored = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                        reverse=True)
        ranking = [w for _, w in scored] + [PLAIN]
        return self._maybe_reexplore(bucket, ranking[0], {PLAIN: plain_rate, **known})

    def _rows_points(self, batch_size: int) -> Optional[list]:
        """``[(extra draft rows, seconds)]`` of the bucket's plain cell and measured verify
        cells at ``batch_size``, sorted; None when fewer than two."""
        bucket = bucket_of(batch_size)
        points = []
        plain = self.step_time(batch_size, PLAIN)
        if plain is not None:
            points.append((0.0, plain))
        for w in self.widths:
            cell = self._cell.get((bucket, w))
            if cell is not None:
                per_request = max(cell[2] - cell[1], 0.0) / cell[1]
                points.append((per_request * batch_size, self._at(cell, batch_size, w)))
        return sorted(points) if len(points) >= 2 else None

    def step_time_rows(self, batch_size: int, extra: int) -> Optional[float]:
        """Estimated seconds of a step of ``batch_size`` requests whose forward runs ``extra``
        draft rows beyond their ``batch_size`` last tokens (a verify of any shape; 0 = the
        plain step). Piecewise linear in ``extra`` through the plain cell and the measured
        verify cells of the batch's bucket (each at its measured rows per request, scaled to
        this batch size); past the last one along the last segment. Falls back to the curve
        over every cell when the bucket has fewer than two cells (None: nothing measured)."""
        if extra <= 0:
            return self.estimate(batch_size, PLAIN)
        return self._rows_times(batch_size, extra)[-1]

    def choose_rows(self, batch_size: int, gains: Sequence[Sequence[float]],
                    horizon: Optional[Horizon] = None):
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
        stalest other cell is run (the plain step, or the best allocation of that cell)."""
        self._decisions += 1
        bs = batch_size
        if len(gains) != bs:
            raise ValueError(f"need one gain list per request ({bs}), got {len(gains)}")
        if horizon is not None and len(horizon.remaining) != bs:
            raise ValueError(f"horizon has {len(horizon.remaining)} requests, batch has {bs}")
        plain = (PLAIN, [0] * bs)
        bucket = bucket_of(bs)
        self.last_advantage = 0.0
        if not any(len(g) and g[0] > 0 for g in gains):
            return plain
        if not self._baseline_measured(bs):
            self.last_advantage = None
            return plain  # measure the baseline at this batch size first (a seeded one too)
        plain_rate = (bs if horizon is None else horizon.useful(bs, 0.0)) / self.estimate(bs, PLAIN)
        nodes = DraftNodes(gains, self.widths[-1])
        times = self._rows_times(bs, len(nodes.gain))
        if None in times:
            return plain
        times = np.asarray(times[1:])  # times[k - 1]: a step with k draft rows
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
                top_rate, top_k = best_prefix(bs, nodes.gain[under], nodes.request[under],
                                                    times, horizon, is_critical)
                if top_k:
                    counts = np.bincount(nodes.request[under[:top_k]], minlength=bs).tolist()
                    width = next(w for w in self.widths if w >= max(counts))
                    if width not in best or top_rate > best[width][0]:
                        best[width] = (top_rate, counts)
        if not best:
            return plain
        self.last_advantage = max(r for r, _ in best.values()) / plain_rate
        known = {w: r for w, (r, _) in best.items() if self.step_time(bs, w) is not None}
        best_known = max([plain_rate] + list(known.values()))
        for w in sorted(best, key=lambda w: -best[w][0]):
            if w not in known and best[w][0] >= self.explore_within * best_known:
                return w, best[w][1]  # explore a promising cell once
        ranking = sorted(((r, w) for w, r in known.items() if r > self.margin * plain_rate),
                         reverse=True)
        choice = ranking[0][1] if ranking else PLAIN
        choice = self._maybe_reexplore(bucket, choice, {PLAIN: plain_rate, **known})
        return plain if choice == PLAIN else (choice, best[choice][1])

    def _rows_times(self, batch_size: int, n: int) -> list:
        """:meth:`step_time_rows` of 0..``n`` draft rows at ``batch_size`` (None where
        unknown), in one walk along the rows points."""
        out = [self.estimate(batch_size, PLAIN)]
        points = self._rows_points(batch_size)
        if not points:
            return out + [self._curve_at(batch_size + k) for k in range(1, n + 1)]
        seg, last, floor = 0, len(points) - 2, max(points[0][1], 1e-9)
        for k in range(1, n + 1):
            while seg < last and k > points[seg + 1][0]:
                seg += 1  # the first segment reaching k (past the end: the last one)
            (x0, y0), (x1, y1) = points[seg], points[seg + 1]
            if x1 - x0 < 1e-9:
                out.append(max(y1, 1e-9))
            else:
                out.append(max(y0 + (y1 - y0) * (k - x0) / (x1 - x0), floor))
        return out

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
                and self._decisions - self._seen.get((bucket, PLAIN), -1) >= self.close_refresh):
            return PLAIN  # a close call: the baseline it hangs on is re-measured often
        if self._decisions % self.reexplore_every or len(rates) < 2:
            return choice
        best = max(r or 0.0 for r in rates.values())
        alternatives = [w for w, r in rates.items() if w != choice
                        and (w == PLAIN or (r or 0.0) >= self.explore_within * best
                             or (bucket, w) not in self._seen)]
        if not alternatives:
            return choice
        return min(alternatives, key=lambda w: (self._seen.get((bucket, w), -1), w != PLAIN,
                                                -(rates[w] or 0.0)))

    def as_dict(self) -> dict:
        buckets = sorted({b for b, _ in self._cell})
        return {
            "calibration": self.calibration,
            # one request's predicted accepted drafts -> factor
            "calibration_by_prediction": self._calibration.by_level(),
            "widths": list(self.widths),
            "seconds_per_request_step": {  # at each bucket's batch size
                str(b): {str(w): self.step_time(b, w) / b for w in self.candidates
                         if (b, w) in self._cell}
                for b in buckets
            },
            "plain_seconds_by_batch_size": {str(b): self._plain[b] for b in self._plain_sizes},
            "measured_at_batch_size": {
                str(b): {str(w): self._cell[(b, w)][1] for w in self.candidates
                         if (b, w) in self._cell}
                for b in buckets
            },
        }
