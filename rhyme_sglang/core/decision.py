"""A decode step's decision: what :meth:`SpecCostModel.decide` (or another width policy,
e.g. :class:`rhyme_sglang.core.width_cycle.CycleWidths`) returns.

Standard library only.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional


class Decision(NamedTuple):
    """One decode step's decision (:meth:`SpecCostModel.decide`)."""

    width: int  # the step's cell: 0 (plain) or a verify width
    counts: Optional[List[int]] = None  # per-request draft nodes (ragged); None: all at ``width``
    # why: "best", "explore" (a cell not yet run here), "reexplore" (the stalest cell, every
    # reexplore_every decisions), "close_call", "probe", "baseline" (plain measured first),
    # or the caller's own ("fixed", "cycle", "rest")
    reason: str = "best"
    # the best verify rate over the plain rate (0: no verify had a gain; None: plain was
    # chosen to measure it); the worker skips drafting after clear losses
    advantage: Optional[float] = 0.0
    promising: bool = False  # the drafts would have allowed a probe
    probe_predicted: float = 0.0  # a probe's face-value expected accepted drafts
