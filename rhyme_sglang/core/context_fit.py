"""How a decode step's seconds grow with its requests' contexts, fitted online.

A decode step's attention reads every request's keys and scores each of its forward rows
against them, so its cost has two context terms the step-cost cells (per batch bucket and
width) do not see::

    seconds = cell(batch size, width) + c_keys * keys + c_rows * row_keys

``keys``: the batch's context tokens (sum of its requests' lengths); ``row_keys``: each draft
row times its request's context (a verify's extra rows; 0 for a plain step). Why it matters:
the CPU attention of SmolLM2 at batch 11 (30 layers, fp32, one thread, CPU flags avx512/amx)
takes 6.8 ms a step at contexts of 100 tokens and 91 ms at 1200, and one extra row per request
adds 5.8 ms at 100 and 32 ms at 1200. In a ``bench_rollout`` run (CPU flags ``avx2``) cells
measured early in a rollout (short contexts) priced width-1 verifies late in it (contexts up
to ~1200) too low: 269 of them lost 12% against plain steps.

:class:`ContextFit` estimates ``(c_keys, c_rows)`` by least squares on innovations within
groups (batch bucket, width): each step is compared with its group's running means (EMAs),
so what a group's fixed and per-row costs are cancels, and the differences in batch size,
keys, row keys and draft rows explain the difference in seconds. Sums are discounted by
``forget`` a step (recent steps weigh most), a ridge pulls toward a prior (zero, or the
coefficients an earlier engine saved), coefficients stay >= 0, and the prior holds until
``min_steps`` innovations were seen. Its users: :class:`rhyme_sglang.core.step_table.StepCostTable`.

Standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

KEY_UNIT = 1000.0  # keys and row keys are fitted in thousands (a better conditioned system)
# regressors: batch size, keys, row keys, draft rows (differences within a group)
_N = 4
_KEYS, _ROW_KEYS = 1, 2


@dataclass
class ContextFit:
    forget: float = 0.995  # weight of the sums kept at each new step (memory ~200 steps)
    group_alpha: float = 0.05  # EMA weight of a step in its group's running means
    ridge: float = 1.0  # pull toward the prior, in squared regressor units
    min_steps: int = 32  # innovations seen before the fit replaces the prior
    outlier: float = 0.5  # an innovation's seconds clipped to this fraction of the group mean
    prior: Tuple[float, float] = (0.0, 0.0)  # (c_keys, c_rows) in seconds per key / row key
    _groups: Dict[Tuple[int, int], list] = field(default_factory=dict)  # -> EMA [y, x0..x3]
    _szz: np.ndarray = field(default_factory=lambda: np.zeros((_N, _N)))
    _szy: np.ndarray = field(default_factory=lambda: np.zeros(_N))
    _seen: int = 0
    _coef: Optional[Tuple[float, float]] = None  # cached; None = stale

    def __post_init__(self) -> None:
        if not 0.0 < self.forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {self.forget}")
        if not 0.0 < self.group_alpha <= 1.0:
            raise ValueError(f"group_alpha must be in (0, 1], got {self.group_alpha}")
        if self.ridge <= 0.0:
            raise ValueError(f"ridge must be > 0, got {self.ridge}")
        self.seed(*self.prior)

    def seed(self, c_keys: float, c_rows: float) -> None:
        """The prior (an earlier engine's fit); the sums seen so far are kept."""
        for name, value in (("c_keys", c_keys), ("c_rows", c_rows)):
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.prior = (float(c_keys), float(c_rows))
        self._coef = None

    def observe(self, group: Tuple[int, int], batch_size: int, seconds: float, keys: float,
                row_keys: float, extra_rows: float) -> None:
        """One step of ``group`` (its batch bucket and width): ``batch_size`` requests holding
        ``keys`` context tokens, ``extra_rows`` draft rows holding ``row_keys`` (row x its
        request's context), in ``seconds``."""
        x = np.array([batch_size, keys / KEY_UNIT, row_keys / KEY_UNIT, extra_rows], dtype=float)
        mean = self._groups.get(group)
        if mean is None:
            self._groups[group] = [float(seconds), *x.tolist()]
            return
        y0, x0 = mean[0], np.asarray(mean[1:])
        z = x - x0
        clip = self.outlier * y0
        r = min(max(seconds - y0, -clip), clip)  # one stall does not bend the fit
        self._szz *= self.forget
        self._szy *= self.forget
        self._szz += np.outer(z, z)
        self._szy += z * r
        self._seen += 1
        self._coef = None
        a = self.group_alpha
        mean[0] = y0 + a * r  # the clipped seconds: a stall would bias the next innovations
        mean[1:] = ((1 - a) * x0 + a * x).tolist()

    def coefficients(self) -> Tuple[float, float]:
        """``(c_keys, c_rows)``: seconds per context token read and per draft row x context
        token (the prior until ``min_steps`` innovations were seen)."""
        if self._coef is None:
            self._coef = self.prior if self._seen < self.min_steps else self._solve()
        return self._coef

    def _solve(self) -> Tuple[float, float]:
        """Ridge least squares toward the prior; a context coefficient that comes out negative
        is held at zero and the rest solved again."""
        center = np.zeros(_N)
        center[_KEYS], center[_ROW_KEYS] = (c * KEY_UNIT for c in self.prior)
        free = list(range(_N))
        theta = np.zeros(_N)
        for _ in range(3):
            a = self._szz[np.ix_(free, free)] + self.ridge * np.eye(len(free))
            b = self._szy[free] + self.ridge * center[free]
            theta = np.zeros(_N)
            theta[free] = np.linalg.solve(a, b)
            negative = [i for i in (_KEYS, _ROW_KEYS) if i in free and theta[i] < 0.0]
            if not negative:
                break
            free = [i for i in free if i not in negative]
        return (max(theta[_KEYS], 0.0) / KEY_UNIT, max(theta[_ROW_KEYS], 0.0) / KEY_UNIT)

    def as_dict(self) -> dict:
        c_keys, c_rows = self.coefficients()
        return {"seconds_per_1k_keys": c_keys * KEY_UNIT, "seconds_per_1k_row_keys": c_rows * KEY_UNIT,
                "innovations": self._seen, "prior_per_1k": [c * KEY_UNIT for c in self.prior]}
