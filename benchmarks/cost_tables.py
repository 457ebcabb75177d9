"""Step-cost tables for the rollout simulator: seconds of a decode step vs (batch, width,
context) and of a prefill forward, from a ``gpu_cost_curve`` table (``StepCostTable``), a
cost model's ``as_dict()`` (``CostModelTable``) or an engine's measured step timeline
(``TimelineTable``); ``load_table`` reads the first two from a JSON file."""

from __future__ import annotations

import json
import os
import statistics
from typing import Dict, List, Sequence

from rhyme_sglang.core.cost_model import SpecCostModel


def _interp(points, x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; linear extrapolation past the last two,
    the first value below the first point."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


class StepCostTable:
    """Seconds of a whole step vs (batch, width, context) from a ``gpu_cost_curve`` table."""

    def __init__(self, table: dict, name: str = "") -> None:
        self.name = name or table.get("device", "table")
        self.kind = table.get("kind", "")
        cells: Dict[int, Dict[int, list]] = {}
        for p in table["points"]:
            if p.get("status") == "ok" and p.get("seconds"):
                cells.setdefault(p["context"], {}).setdefault(p["width"], []).append(
                    (p["batch_size"], p["seconds"]))
        if not cells:
            raise ValueError(f"cost table {self.name!r} has no measured points")
        self._cells = {c: {w: sorted(v) for w, v in ws.items()} for c, ws in cells.items()}
        lo = min(self._cells)
        by_tokens: Dict[int, float] = {}
        for w, pts in self._cells[lo].items():
            for b, s in pts:
                by_tokens[b * (w + 1)] = min(s, by_tokens.get(b * (w + 1), s))
        self._tokens = sorted(by_tokens.items())

    def _at_context(self, c: int, batch: int, width: int) -> float:
        ws = self._cells[c]
        per_width = sorted((w, _interp(pts, batch)) for w, pts in ws.items())
        return _interp(per_width, width) if len(per_width) > 1 else per_width[0][1]

    def seconds(self, batch: int, width: int, context: float) -> float:
        ctxs = sorted(self._cells)
        per_ctx = [(c, self._at_context(c, batch, width)) for c in ctxs]
        return max(_interp(per_ctx, context), 1e-9)

    def forward_seconds(self, tokens: int) -> float:
        """One forward over ``tokens`` (a prefill), from the smallest context's points."""
        return max(_interp(self._tokens, tokens), 1e-9)


class CostModelTable:
    """Seconds of a step from a cost model's ``as_dict()`` (no context dependence)."""

    def __init__(self, table: dict, name: str = "cost model") -> None:
        self.name, self.kind = name, "measurement"
        widths = table.get("widths") or [1]
        self.model = SpecCostModel(widths=tuple(widths))
        cells = {}
        for b, row in table.get("seconds_per_request_step", {}).items():
            for w, s in row.items():
                if s is not None and (int(w) == 0 or int(w) in self.model.widths):
                    cells[(int(b), int(w))] = s * int(b)
        if not cells:
            raise ValueError(f"{name}: the cost model has no measured steps")
        self.model.seed(cells)

    def seconds(self, batch: int, width: int, context: float) -> float:
        return self.model.estimate(batch, width)

    def forward_seconds(self, tokens: int) -> float:
        return self.model.estimate(1, max(tokens - 1, 0))


class TimelineTable:
    """Seconds of a step from an engine's measured step timeline (``Engine.rhyme_breakdown``
    ``timeline`` rows ``[t, kind, batch_size, seconds, tokens]``, kinds ``prefill``, ``plain``,
    ``verify_w<width>``): the median of each measured (batch size, width) cell, interpolated
    over batch size within a width, then over width; prefill from a least-squares line of
    seconds vs tokens. Each mode is charged its own engine's costs (vanilla SGLang's plain
    steps run under the overlap scheduler, RHYME's under the synchronous one)."""

    def __init__(self, timelines: Sequence[Sequence], name: str = "timeline") -> None:
        self.name, self.kind = name, "measurement"
        cells: Dict[int, Dict[int, List[float]]] = {}
        prefill: List[tuple] = []
        for row in (r for tl in timelines for r in tl):
            _, kind, batch, seconds, tokens = row[:5]
            if kind == "prefill":
                prefill.append((tokens, seconds))
            elif kind == "plain" or kind.startswith("verify_w"):
                width = 0 if kind == "plain" else int(kind[len("verify_w"):])
                cells.setdefault(width, {}).setdefault(int(batch), []).append(seconds)
        if not cells:
            raise ValueError(f"{name}: the timeline has no decode steps")
        self._cells = {w: sorted((b, statistics.fmean(v)) for b, v in bs.items())
                       for w, bs in cells.items()}
        self._prefill = _line(prefill) if prefill else None

    def seconds(self, batch: int, width: float, context: float) -> float:
        per_width = sorted((w, _interp(pts, batch)) for w, pts in self._cells.items())
        return max(_interp(per_width, width), 1e-9)

    def forward_seconds(self, tokens: int) -> float:
        if self._prefill is None:
            return self.seconds(1, max(tokens - 1, 0), 0.0)
        a, b = self._prefill
        return max(a + b * tokens, 1e-9)


def _line(points: Sequence[tuple]) -> tuple:
    """Least-squares (intercept, slope) of y over x (a proportional fit for one distinct x)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0, my / mx if mx else 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - slope * mx, slope


def load_table(path: str):
    with open(path) as fh:
        table = json.load(fh)
    if "points" in table:
        return StepCostTable(table, os.path.basename(path))
    if "seconds_per_request_step" in table:
        return CostModelTable(table, os.path.basename(path))
    raise ValueError(f"{path}: neither a gpu_cost_curve table nor a cost model's as_dict()")
