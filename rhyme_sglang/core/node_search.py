"""The batch's draft nodes as arrays, and the best prefix of a node order: the two pieces of
:meth:`rhyme_sglang.core.cost_model.SpecCostModel.decide` that run on every decode step
(at batch 32 x 16 nodes it scores hundreds of candidate steps).

Standard library and numpy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from rhyme_sglang.core.horizon import Horizon


class DraftNodes:
    """Every draft node of a batch with a positive gain, best first (ties: the shallower
    node, then batch order): its ``gain``, ``request`` and ``rank`` in that request's
    best-first order, as arrays; nodes deeper than ``deepest`` are left out."""

    def __init__(self, gains: Sequence[Sequence[float]], deepest: int):
        rows = [row[:deepest] for row in gains]
        sizes = [len(row) for row in rows]
        gain = np.fromiter((g for row in rows for g in row), dtype=np.float64, count=sum(sizes))
        request = np.repeat(np.arange(len(rows)), sizes)
        rank = np.arange(len(gain)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        keep = gain > 0
        gain, request, rank = gain[keep], request[keep], rank[keep]
        order = np.lexsort((rank, -gain))  # stable: equal keys keep batch order
        self.gain, self.request, self.rank = gain[order], request[order], rank[order]


def best_prefix(batch_size: int, gain, request, times, horizon: Optional[Horizon],
                is_critical) -> Tuple[float, int]:
    """``(rate, k)``: the best rate of verifying the first ``k`` of a node order (their
    ``gain`` and ``request`` arrays, in the order they are taken) and that ``k`` (the first
    best; 0 when no rate is positive). ``times[k - 1]``: seconds of a step with ``k`` draft
    rows; ``is_critical[i]``: request ``i`` is on the critical path (with a ``horizon``, a
    step's tokens count as far as :meth:`Horizon.limit` of the critical requests' mean gain)."""
    if not len(gain):
        return 0.0, 0
    rows = batch_size if horizon is None else horizon.rows(batch_size)
    tokens = rows + np.cumsum(gain)  # cumsum adds in order, as a loop would
    if horizon is not None:
        share = int(is_critical.sum())
        crit = np.cumsum(np.where(is_critical[request], gain, 0.0))
        tokens = np.minimum(tokens, horizon.limit(crit / share))
    rates = tokens / times[: len(gain)]
    k = int(np.argmax(rates))  # the first best
    return (float(rates[k]), k + 1) if rates[k] > 0.0 else (0.0, 0)
