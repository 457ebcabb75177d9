"""Measured seconds of decode steps, per (power-of-two batch bucket, width).

:class:`StepCostTable` keeps, for each cell, the seconds of a whole step, the batch size and
the forward rows it was measured at (EMAs), and each plain step's seconds at its exact batch
size. It reads a width's cost at any batch size piecewise linearly between that width's cells,
a step's cost at any number of draft rows through the bucket's plain and verify cells, and an
unmeasured cell from the curve of seconds over tokens per forward of every cell. One
measurement moves a cell at most ``max_jump`` times its value; a seeded cell (a prior from an
earlier engine) gives way to its first measurement. A cell last measured ``stale_after`` or
more owner's decisions ago takes a new measurement with weight ``stale_alpha``: cells that
only probes and re-explorations refresh would otherwise need tens of them to forget a stall.
:mod:`.cost_model` decides on it (its docstring says why each rule is there).

Context: a step's attention grows with its requests' contexts, which the cells do not key
on. Each cell also keeps (EMAs) the context tokens its steps read (``keys``) and its draft
rows x their contexts (``row_keys``), and :class:`rhyme_sglang.core.context_fit.ContextFit`
fits what one of each costs. Cells are read context-free (their seconds less those terms)
and a step's estimate adds its own terms back, so a verify cell measured at 100-token
contexts is not taken for a verify at 1200.
Callers that pass no contexts get the cells as measured.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

from rhyme_sglang.core.context_fit import ContextFit

PLAIN = 0  # the width of a plain decode step


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass
class StepCostTable:
    widths: Tuple[int, ...]  # the verify widths it keeps cells for (checked by the owner)
    alpha: float = 0.2  # EMA weight of a new measurement
    stale_after: int = 32  # owner's decisions since a cell's last measurement that make it stale
    stale_alpha: float = 0.5  # EMA weight of a stale cell's new measurement
    max_jump: float = 2.0  # one measurement moves a cell by at most this factor
    baseline_near: float = 0.1  # plain measured within this fraction of a batch size (>= 1 request)
    floor: float = 0.1  # a cell's context-free seconds stay >= this share of its seconds
    context: ContextFit = field(default_factory=ContextFit)
    # (bucket, width) -> [seconds of a whole step, batch size, forward rows, keys, row keys],
    # EMAs of what was measured
    _cell: Dict[Tuple[int, int], list] = field(default_factory=dict)
    _seen: Dict[Tuple[int, int], int] = field(default_factory=dict)  # cell -> owner's clock at its last measurement
    _curve: Optional[list] = None  # (tokens per forward, seconds) of every cell; None = stale
    _by_width: Dict[int, list] = field(default_factory=dict)  # width -> sorted points; {} = stale
    # batch size -> [seconds of a plain step at exactly that size, its keys] (EMAs), measured
    # here; the baseline a verify is judged against, read near the decided size (baseline_near)
    _plain: Dict[int, list] = field(default_factory=dict)
    _plain_sizes: list = field(default_factory=list)  # sorted keys of _plain

    def measured_at(self, key: Tuple[int, int]) -> int:
        """The owner's clock at the cell's last measurement; -1 when never measured here
        (a seeded cell included)."""
        return self._seen.get(key, -1)

    def observe(self, batch_size: int, width: int, seconds: float, rows: Optional[int] = None,
                now: int = 0, keys: float = 0.0, row_keys: float = 0.0) -> None:
        """Record the wall time of one whole step of ``batch_size`` requests at ``width``.

        ``rows``: tokens the step's forward ran, when a ragged verify ran fewer than
        ``batch_size * (width + 1)`` (requests verifying fewer nodes than ``width``); its
        cell is then that of the step's largest request width. ``now``: the owner's clock
        (the cost model's decision count), kept as the cell's last measurement. ``keys``:
        the batch's context tokens; ``row_keys``: its draft rows x their requests' contexts
        (module docstring; 0 when unknown: the step is then taken as context-free)."""
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
        if keys < 0 or row_keys < 0:
            raise ValueError(f"keys and row_keys must be >= 0, got {keys!r} and {row_keys!r}")
        key = (bucket_of(batch_size), width)
        if keys > 0:
            self.context.observe(key, batch_size, seconds, keys, row_keys, rows - batch_size)
        if width == PLAIN:
            self._observe_plain(batch_size, seconds, keys)
        cell = self._cell.get(key)
        measured = [seconds, float(batch_size), float(rows), float(keys), float(row_keys)]
        if cell is None or key not in self._seen:  # a seeded prior gives way to the first measurement
            self._cell[key] = measured
        else:
            # the cell's estimate at this batch size and context
            old = self._at(cell, batch_size, width) + self._context_seconds(keys, row_keys)
            measured[0] = self._bounded(seconds, old)
            alpha = self.stale_alpha if now - self._seen[key] >= self.stale_after else self.alpha
            for i, value in enumerate(measured):
                cell[i] = (1 - alpha) * cell[i] + alpha * value
        self._seen[key] = now
        self._stale()

    def _context_seconds(self, keys: float, row_keys: float) -> float:
        c_keys, c_rows = self.context.coefficients()
        return c_keys * keys + c_rows * row_keys

    def _free(self, seconds: float, keys: float, row_keys: float = 0.0) -> float:
        """Seconds less the context terms of the steps they were measured at."""
        return max(seconds - self._context_seconds(keys, row_keys), self.floor * seconds)

    def _cell_free(self, cell) -> float:
        return self._free(cell[0], cell[3], cell[4])

    def _bounded(self, seconds: float, old: float) -> float:
        """A measurement moves an estimate at most ``max_jump`` times its current value."""
        return min(max(seconds, old / self.max_jump), old * self.max_jump)

    def _observe_plain(self, batch_size: int, seconds: float, keys: float) -> None:
        old = self._plain.get(batch_size)
        if old is None:
            bisect.insort(self._plain_sizes, batch_size)
            self._plain[batch_size] = [seconds, float(keys)]
            return
        seconds = self._bounded(seconds, self._free(*old) + self._context_seconds(keys, 0.0))
        old[0] = (1 - self.alpha) * old[0] + self.alpha * seconds
        old[1] = (1 - self.alpha) * old[1] + self.alpha * keys

    def _near_plain(self, batch_size: int) -> Optional[float]:
        """A plain step's context-free seconds at ``batch_size`` from this model's plain steps at sizes
        within ``baseline_near`` of it (at least one request): the exact size, else linear
        between the nearest measured sizes on each side, else the nearest one scaled along its
        bucket's cell. None when no plain step was measured that near.

        Why not the cells alone: a cell is an EMA of (batch size, seconds) over every step of
        its bucket, and its reading at another size is extrapolated. At batch 16 a plain cell
        measured at 11.8 requests (the steps while a round's prefills were still joining) read
        56.7 ms against 42-44 ms measured at 16, and width-1 verifies (51 ms) looked cheaper
        than plain steps for a whole round (bench_serving)."""
        exact = self._plain.get(batch_size)
        if exact is not None:
            return self._free(*exact)
        reach = max(1.0, self.baseline_near * batch_size)
        sizes = self._plain_sizes
        i = bisect.bisect_left(sizes, batch_size)
        lo = sizes[i - 1] if i > 0 and batch_size - sizes[i - 1] <= reach else None
        hi = sizes[i] if i < len(sizes) and sizes[i] - batch_size <= reach else None
        if lo is not None and hi is not None:
            y0, y1 = self._free(*self._plain[lo]), self._free(*self._plain[hi])
            return y0 + (y1 - y0) * (batch_size - lo) / (hi - lo)
        near = lo if lo is not None else hi
        if near is None:
            return None
        y = self._free(*self._plain[near])
        cell = self._cell.get((bucket_of(batch_size), PLAIN))
        if cell is None:
            return y * batch_size / near
        return y * self._at(cell, batch_size, PLAIN) / max(self._at(cell, near, PLAIN), 1e-12)

    def seed(self, table: Mapping[Tuple[int, int], float],
             rows: Optional[Mapping[Tuple[int, int], float]] = None,
             context: Optional[Tuple[float, float]] = None) -> int:
        """Prior step costs ``{(batch_size, width): seconds per whole step}``, as if measured
        (a cost table of another run or machine); later measurements move them. ``rows``:
        the forward rows per request each cell's steps ran (:meth:`rows_table`; a ragged
        verify cell ran fewer than ``width + 1``); a cell without one ran them all.
        ``context``: the ``(c_keys, c_rows)`` the table was saved with (its seconds are then
        context-free, as :meth:`table` gives them), the context fit's prior. Returns how many
        cells it took (widths this model does not use are skipped). Seeded cells count as
        never observed by this model: the stalest, refreshed first, replaced by their first
        measurement."""
        if context is not None:
            self.context.seed(*context)
        taken = 0
        for (batch_size, width), seconds in table.items():
            if width == PLAIN or width in self.widths:
                key = (bucket_of(batch_size), width)
                per_request = (rows or {}).get((batch_size, width), width + 1)
                per_request = min(max(float(per_request), 1.0), float(width + 1))
                self._cell[key] = [float(seconds), float(batch_size), batch_size * per_request, 0.0, 0.0]
                self._seen.pop(key, None)
                taken += 1
        self._stale()
        return taken

    def table(self) -> Dict[Tuple[int, int], float]:
        """Each measured cell's context-free step seconds at its bucket's batch size,
        ``{(bucket, width): seconds}``: the form :meth:`seed` takes (a round trip, with
        :meth:`rows_table` for ragged cells and ``context.coefficients()``, gives the same
        model at every bucket size)."""
        return {(b, w): self.step_time(b, w) for (b, w) in self._cell}

    def rows_table(self) -> Dict[Tuple[int, int], float]:
        """Each cell's forward rows per request (EMA over its steps), ``{(bucket, width):
        rows}``: less than ``width + 1`` where ragged verifies ran fewer nodes. Without it a
        seeded ragged cell would stand for full-width steps and make rows look cheaper than
        they are (the next engine then over-verifies until it re-measures each cell)."""
        return {(b, w): cell[2] / cell[1] for (b, w), cell in self._cell.items()}

    def contexts(self) -> Dict[Tuple[int, int], Tuple[float, float]]:
        """Each cell's context per request and per draft row (EMAs over its steps),
        ``{(bucket, width): (keys / batch size, row keys / draft rows)}`` (0 where none)."""
        return {(b, w): (cell[3] / cell[1], cell[4] / max(cell[2] - cell[1], 1e-9)
                         if cell[2] > cell[1] else 0.0)
                for (b, w), cell in self._cell.items()}

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
                (cell[1], self._cell_free(cell)) for (_, w), cell in self._cell.items() if w == width)
        return points

    def _at(self, cell, batch_size: int, width: int) -> float:
        """Context-free seconds of a ``width`` step at ``batch_size``, from its cells:
        piecewise linear in batch size between their measured points (a cell measured while a
        batch was filling up, at 17 requests, is not taken for 32 requests' cost), extended
        past the ends along the nearest segment (never below proportional to zero); one point
        alone scales proportionally. ``cell`` is the one the batch size falls in."""
        points = self._points(width)
        if len(points) < 2:
            return self._cell_free(cell) * batch_size / cell[1]
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

    def step_time(self, batch_size: int, width: int, keys: float = 0.0,
                  row_keys: float = 0.0) -> Optional[float]:
        """Estimated seconds of a whole step from this width's measurements (None when the
        batch size's bucket was never measured at that width), at a context of ``keys`` and
        ``row_keys`` (:meth:`observe`; 0: context-free)."""
        cell = self._cell.get((bucket_of(batch_size), width))
        if cell is None:
            return None
        near = self._near_plain(batch_size) if width == PLAIN else None
        free = self._at(cell, batch_size, width) if near is None else near
        return free + self._context_seconds(keys, row_keys)

    def baseline_measured(self, batch_size: int) -> bool:
        """Whether this model ran plain steps in the batch size's bucket (a seeded cell is a
        prior, not a measurement) and within ``baseline_near`` of the size itself."""
        return ((bucket_of(batch_size), PLAIN) in self._seen
                and self._near_plain(batch_size) is not None)

    def estimate(self, batch_size: int, width: int, keys: float = 0.0,
                 row_keys: float = 0.0) -> Optional[float]:
        """Measured seconds of a step, else the tokens-per-forward curve's estimate (at a
        context of ``keys`` and ``row_keys``, as :meth:`step_time`)."""
        measured = self.step_time(batch_size, width, keys, row_keys)
        if measured is not None:
            return measured
        free = self._curve_at(batch_size * (width + 1))
        return None if free is None else free + self._context_seconds(keys, row_keys)

    def _curve_at(self, tokens: float) -> Optional[float]:
        """Context-free seconds of a forward of ``tokens`` tokens on the curve over every
        measured cell (None when nothing was measured)."""
        if self._curve is None:  # rebuilt after a measurement, not per estimate
            self._curve = sorted({c[2]: self._cell_free(c) for c in self._cell.values()}.items())
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

    def _rows_points(self, batch_size: int) -> Optional[list]:
        """``[(extra draft rows, context-free seconds)]`` of the bucket's plain cell and
        measured verify cells at ``batch_size``, sorted; None when fewer than two."""
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

    def step_time_rows(self, batch_size: int, extra: int, keys: float = 0.0,
                       row_keys: float = 0.0) -> Optional[float]:
        """Estimated seconds of a step of ``batch_size`` requests whose forward runs ``extra``
        draft rows beyond their ``batch_size`` last tokens (a verify of any shape; 0 = the
        plain step). Piecewise linear in ``extra`` through the plain cell and the measured
        verify cells of the batch's bucket (each at its measured rows per request, scaled to
        this batch size); past the last one along the last segment, or the chord from the
        first point to the last where that is steeper (cells measured with ~2 rows a
        step and a noisy last segment priced 23 rows at batch 12 at 0.6 ms a row, 71.6 ms a
        step against 126 ms measured, ~3 ms a row). Falls back to the curve
        over every cell when the bucket has fewer than two cells (None: nothing measured).
        At a context of ``keys`` and ``row_keys`` (:meth:`observe`; 0: context-free)."""
        if extra <= 0:
            return self.estimate(batch_size, PLAIN, keys)
        last = self.rows_times(batch_size, extra)[-1]
        return None if last is None else last + self._context_seconds(keys, row_keys)

    def rows_times(self, batch_size: int, n: int, keys: float = 0.0) -> list:
        """:meth:`step_time_rows` of 0..``n`` draft rows at ``batch_size`` (None where
        unknown), in one walk along the rows points, at a batch context of ``keys`` and
        without the draft rows' context term (``context.coefficients()[1]`` times each
        row's context: the caller knows which rows it adds)."""
        add = self._context_seconds(keys, 0.0)
        return [None if t is None else t + add for t in self._rows_times(batch_size, n)]

    def _rows_times(self, batch_size: int, n: int) -> list:
        out = [self.estimate(batch_size, PLAIN)]
        points = self._rows_points(batch_size)
        if not points:
            return out + [self._curve_at(batch_size + k) for k in range(1, n + 1)]
        seg, last, floor = 0, len(points) - 2, max(points[0][1], 1e-9)
        (xa, ya), (xz, yz) = points[0], points[-1]
        chord = (yz - ya) / (xz - xa) if xz - xa >= 1e-9 else 0.0
        for k in range(1, n + 1):
            while seg < last and k > points[seg + 1][0]:
                seg += 1  # the first segment reaching k (past the end: the last one)
            (x0, y0), (x1, y1) = points[seg], points[seg + 1]
            if k > xz:  # past the last measured rows: never cheaper a row than on average
                slope = (y1 - y0) / (x1 - x0) if x1 - x0 >= 1e-9 else 0.0
                out.append(max(yz + max(slope, chord) * (k - xz), floor))
            elif x1 - x0 < 1e-9:
                out.append(max(y1, 1e-9))
            else:
                out.append(max(y0 + (y1 - y0) * (k - x0) / (x1 - x0), floor))
        return out

    def as_dict(self, candidates) -> dict:
        buckets = sorted({b for b, _ in self._cell})
        contexts = self.contexts()
        return {
            "seconds_per_request_step": {  # at each bucket's batch size, context-free
                str(b): {str(w): self.step_time(b, w) / b for w in candidates if (b, w) in self._cell}
                for b in buckets
            },
            "plain_seconds_by_batch_size": {str(b): self._plain[b][0] for b in self._plain_sizes},
            "context": self.context.as_dict(),
            # context tokens per request and per draft row of each cell's steps (EMAs)
            "measured_at_context": {
                str(b): {str(w): [round(x, 1) for x in contexts[(b, w)]]
                         for w in candidates if (b, w) in contexts}
                for b in buckets
            },
            "measured_at_batch_size": {
                str(b): {str(w): self._cell[(b, w)][1] for w in candidates if (b, w) in self._cell}
                for b in buckets
            },
        }
