"""Multi-engine load balance: group assignment (LPT with history affinity) and utilisation.

Whole prompt groups go to one engine (siblings share the prompt's prefix cache and the
prompt's RHYME history lives on the engine that served it). ``assign_groups`` keeps a
group on its previous engine while that engine stays under its fair share of predicted
load (times ``1 + tolerance``) and places the rest by LPT, so balance costs little history
locality. Busy/idle accounting turns per-request (start, end) intervals into the bubble ratio.
"""

from __future__ import annotations

import heapq
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from rhyme_sglang.core import assign_groups_lpt, assign_groups_round_robin


def assign_groups(groups: Sequence[Hashable], loads: Sequence[float], num_engines: int,
                  policy: str = "lpt", previous: Optional[Mapping[Hashable, int]] = None,
                  tolerance: float = 0.1) -> List[List[Hashable]]:
    """One list of groups per engine. ``policy``: 'lpt' (with affinity to ``previous``) or
    'round_robin'. Engines in ``previous`` that no longer exist are ignored."""
    if policy == "round_robin":
        return assign_groups_round_robin(list(groups), num_engines)
    if policy != "lpt":
        raise ValueError(f"policy must be 'lpt' or 'round_robin', got {policy!r}")
    if not previous:
        return assign_groups_lpt(list(groups), list(loads), num_engines)
    if len(groups) != len(loads):
        raise ValueError(f"loads has {len(loads)} entries for {len(groups)} groups")
    fair = sum(loads) / num_engines * (1.0 + tolerance)
    totals = [0.0] * num_engines
    out: List[List[Hashable]] = [[] for _ in range(num_engines)]
    rest = []
    for i in sorted(range(len(groups)), key=lambda i: -loads[i]):
        e = previous.get(groups[i])
        if e is not None and 0 <= e < num_engines and totals[e] + loads[i] <= fair:
            out[e].append(groups[i])
            totals[e] += loads[i]
        else:
            rest.append(i)
    heap = [(totals[e], e) for e in range(num_engines)]
    heapq.heapify(heap)
    for i in rest:  # already in decreasing load order
        total, e = heapq.heappop(heap)
        out[e].append(groups[i])
        heapq.heappush(heap, (total + loads[i], e))
    return out


def predicted_makespan(assignment: Sequence[Sequence[Hashable]], load: Mapping[Hashable, float]) -> float:
    return max((sum(load[g] for g in eng) for eng in assignment), default=0.0)


def imbalance(assignment: Sequence[Sequence[Hashable]], load: Mapping[Hashable, float]) -> float:
    """Predicted makespan / ideal (mean) engine load; 1.0 is perfect balance."""
    totals = [sum(load[g] for g in eng) for eng in assignment]
    mean = sum(totals) / max(len(totals), 1)
    return max(totals) / mean if mean > 0 else 1.0


def merge_intervals(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def utilisation(busy: Mapping[int, Sequence[Tuple[float, float]]], num_engines: int,
                start: float, end: float) -> Dict[str, float]:
    """Makespan, per-engine busy seconds and the bubble ratio (idle engine-seconds over
    ``num_engines * makespan``; 0 = every engine busy until the last one finished)."""
    makespan = max(end - start, 1e-9)
    busy_s = [sum(e - s for s, e in merge_intervals(busy.get(i, ()))) for i in range(num_engines)]
    idle = sum(max(makespan - b, 0.0) for b in busy_s)
    return {"makespan_s": makespan, "bubble_ratio": idle / (num_engines * makespan),
            "engine_busy_s": busy_s}
