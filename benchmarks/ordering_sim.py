"""Makespan of one engine's continuous batching under a waiting-queue policy, simulated.

Used by ``bench_rollout``'s ordering run to explain its measurement: given the requests' real
lengths, the policy's predictions and a step-cost curve (seconds per decode step as a function
of the running batch size), it replays SGLang-style continuous batching (each step every
running request emits one token; finished requests leave and the head of the waiting queue
takes their slots) for FCFS and for longest-predicted-first with prompt groups kept together.
Comparing a measured CPU curve with a flat one (a memory-bound GPU decode step costs about the
same for 1 or 8 requests) shows how much of ordering's gain the hardware can show.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from rhyme_sglang.core import lpt_group_order

Request = Tuple[str, int]  # (prompt id, length in tokens), in submission order


def order_queue(requests: Sequence[Request], predicted: Dict[str, float], policy: str) -> List[Request]:
    """FCFS keeps submission order; LPT sorts by predicted length, longest first, keeping each
    prompt's group together in order of first submission (as the RHYME worker does)."""
    if policy == "fcfs":
        return list(requests)
    if policy != "lpt":
        raise ValueError(f"policy must be 'fcfs' or 'lpt', got {policy!r}")
    return [requests[i] for i in lpt_group_order([pid for pid, _ in requests], predicted)]


def makespan(requests: Sequence[Request], predicted: Dict[str, float], policy: str, slots: int,
             step_seconds: Callable[[int], float]) -> float:
    """Seconds until the last request finishes (all requests waiting at time 0)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    queue = order_queue(requests, predicted, policy)
    if any(n < 0 for _, n in queue):
        raise ValueError("request lengths must be >= 0")
    running: List[int] = []
    t, head = 0.0, 0
    while head < len(queue) or running:
        while len(running) < slots and head < len(queue):
            if queue[head][1] > 0:
                running.append(queue[head][1])
            head += 1
        if not running:
            break
        t += step_seconds(len(running))
        running = [n - 1 for n in running if n > 1]
    return t


def step_curve(cost_model: dict) -> Callable[[int], float]:
    """Seconds per plain decode step vs batch size, from ``rhyme_stats()["cost_model"]``
    (seconds per request-step per power-of-two bucket; linear between measured buckets)."""
    points = sorted((int(b), v["plain"]) for b, v in cost_model.get("seconds_per_request_step", {}).items()
                    if v.get("plain"))
    if not points:
        raise ValueError("the cost model has no plain-decode measurements")

    per_step = [(b, b * s) for b, s in points]  # seconds per whole step at each bucket

    def seconds(batch: int) -> float:
        if batch <= per_step[0][0]:
            return per_step[0][1]
        for (b0, s0), (b1, s1) in zip(per_step, per_step[1:]):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        b_last, s_last = per_step[-1]
        return s_last * batch / b_last

    return seconds


def compare(requests: Sequence[Request], predicted: Dict[str, float], slots: int,
            step_seconds: Callable[[int], float]) -> dict:
    """Simulated FCFS and LPT makespans under a step-cost curve."""
    fcfs = makespan(requests, predicted, "fcfs", slots, step_seconds)
    lpt = makespan(requests, predicted, "lpt", slots, step_seconds)
    return {"fcfs_s": fcfs, "lpt_s": lpt, "lpt_speedup": fcfs / lpt if lpt else None}
