"""Pure ordering policies: longest-processing-time-first ordering and engine assignment."""

from __future__ import annotations

import heapq
from typing import Callable, Collection, List, Mapping, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")


def _check_lengths(items: Sequence, values: Sequence[float], name: str) -> None:
    if len(items) != len(values):
        raise ValueError(f"{name} has {len(values)} entries for {len(items)} items")
    for v in values:
        if not v >= 0:  # also rejects NaN
            raise ValueError(f"{name} must be >= 0, got {v!r}")


def lpt_order(items: Sequence[T], predicted_lengths: Sequence[float]) -> List[T]:
    """Items sorted longest predicted first; ties keep their input order."""
    _check_lengths(items, predicted_lengths, "predicted_lengths")
    order = sorted(range(len(items)), key=lambda i: -predicted_lengths[i])
    return [items[i] for i in order]


def lpt_group_order(keys: Sequence, predicted: Mapping) -> List[int]:
    """Indices of a queue ordered longest predicted first, each key's items kept together in
    order of the key's first appearance (prompt groups stay adjacent, for prefix-cache reuse);
    keys missing from `predicted` count as 0."""
    first: dict = {}
    for pos, key in enumerate(keys):
        first.setdefault(key, pos)
    return sorted(range(len(keys)), key=lambda i: (-predicted.get(keys[i], 0.0), first[keys[i]]))


MIN_SHARED = 32  # prompt tokens worth holding a sibling back a prefill pass for


def group_leaders(keys: Sequence, running_keys: Collection, prompt_lens: Sequence[int],
                  prefilling_keys: Collection = (), min_shared: int = MIN_SHARED,
                  is_cached: Optional[Callable[[int], bool]] = None) -> List[bool]:
    """Which waiting requests a prefill pass may take now: the first request of each prompt
    group, and every request whose group already has a request running or whose prompt the
    prefix cache already holds (``is_cached(i)``: whether it holds waiting request i's prompt
    but for fewer than ``min_shared`` tokens; asked at most once per group, for its first
    waiting request, and only once a sibling would otherwise wait). The rest wait a pass, so
    they prefill from the cache instead of beside a sibling in one batch, where none of them
    can hit it; so do the siblings of a prompt being prefilled in chunks (``prefilling_keys``).
    Prompts shorter than ``min_shared`` tokens are never held back (too little to share)."""
    _check_lengths(keys, prompt_lens, "prompt_lens")
    started = set(running_keys) | set(prefilling_keys)
    free = set(running_keys)
    first: dict = {}
    take = []
    for i, (key, length) in enumerate(zip(keys, prompt_lens)):
        if length < min_shared:
            take.append(True)
            continue
        leader = first.setdefault(key, i)
        if key in started and key not in free and is_cached is not None and is_cached(leader):
            free.add(key)
        take.append(key not in started or key in free)
        started.add(key)
    return take


def _check_engines(num_engines: int) -> None:
    if not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"num_engines must be an int >= 1, got {num_engines!r}")


def assign_groups_lpt(groups: Sequence[T], loads: Sequence[float], num_engines: int) -> List[List[T]]:
    """Greedy LPT: take groups by decreasing load and give each to the least-loaded engine
    (lowest index on ties). Returns one list of groups per engine."""
    _check_engines(num_engines)
    _check_lengths(groups, loads, "loads")
    heap: List[Tuple[float, int]] = [(0.0, e) for e in range(num_engines)]
    out: List[List[T]] = [[] for _ in range(num_engines)]
    for i in sorted(range(len(groups)), key=lambda i: -loads[i]):
        total, eng = heapq.heappop(heap)
        out[eng].append(groups[i])
        heapq.heappush(heap, (total + loads[i], eng))
    return out


def assign_groups_round_robin(groups: Sequence[T], num_engines: int) -> List[List[T]]:
    """Group i goes to engine i mod num_engines (the baseline LPT is compared against)."""
    _check_engines(num_engines)
    out: List[List[T]] = [[] for _ in range(num_engines)]
    for i, g in enumerate(groups):
        out[i % num_engines].append(g)
    return out


def makespan(assignment: Sequence[Sequence[T]], load_of) -> float:
    """Largest total load over engines, `load_of(group)` giving each group's load."""
    return max((sum(load_of(g) for g in eng) for eng in assignment), default=0.0)
