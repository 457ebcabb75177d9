"""Continuous batching on N engines under a waiting-queue policy, simulated step by step.

Each engine runs SGLang-style continuous batching: at most ``slots`` requests run; each step
every running request emits tokens (one, or more when a verify step accepts drafts); finished
requests leave and the head of the waiting queue takes their slots. :func:`simulate` runs any
number of engines on one clock (the engine that is earliest steps next), with the queue in
FCFS order or longest-predicted-first with prompt groups kept together (as the RHYME worker
does), and optionally migrates overrunning requests to an idle engine as ``rl_driver.dispatch``
does. What a step emits and costs comes from a :class:`Stepper`: :class:`UnitStepper` (one
token per request, a step-cost curve of the batch size) explains ``bench_ordering``'s
measurement; :mod:`benchmarks.rollout_sim` replays a trace's drafts through one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rhyme_sglang.core import lpt_group_order

Request = Tuple[str, int]  # (prompt id, length in tokens), in submission order


@dataclass
class SimRequest:
    """One response being generated: ``length`` tokens in all, ``done`` so far."""

    key: str
    group: str
    length: int
    predicted: float = 0.0
    prompt_len: int = 0
    payload: Any = None  # what the stepper needs (e.g. the trace record)
    done: int = 0
    migrations: int = 0
    finish_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ValueError(f"request lengths must be >= 0, got {self.length} for {self.key!r}")


class Stepper:
    """What one engine step emits and costs (subclass per workload)."""

    def admit(self, engine: int, requests: List[SimRequest]) -> float:
        """Seconds to admit (prefill) newly running requests; 0 by default."""
        return 0.0

    def step(self, engine: int, running: List[SimRequest]) -> Tuple[float, List[int]]:
        """(seconds of the step, tokens each running request emits, each >= 1)."""
        raise NotImplementedError

    def queue(self, engine: int, waiting: List[SimRequest]) -> None:
        """The engine's waiting queue, seen just before each of its steps (no-op by default)."""

    def finish(self, engine: int, request: SimRequest) -> None:
        pass


class UnitStepper(Stepper):
    """One token per running request per step; the step costs ``step_seconds(batch)``."""

    def __init__(self, step_seconds: Callable[[int], float]) -> None:
        self.step_seconds = step_seconds

    def step(self, engine, running):
        return self.step_seconds(len(running)), [1] * len(running)


@dataclass(frozen=True)
class Migration:
    """Overrun migration as ``rl_driver.dispatch.DispatchConfig`` does it: when an engine is
    idle and another runs requests past ``overrun_factor`` x their predicted length with at
    least ``min_remaining_tokens`` left, up to ``ceil(load * idle / (idle + 1))`` of them move
    (their generated tokens travel with them; the new engine's ``Stepper.admit`` charges the
    re-prefill; the driver's polling delay is not modelled)."""

    overrun_factor: float = 1.5
    min_remaining_tokens: int = 8
    max_migrations: int = 2

    def __post_init__(self) -> None:
        if self.overrun_factor <= 0 or self.min_remaining_tokens < 0 or self.max_migrations < 0:
            raise ValueError(f"bad migration settings {self}")


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
    """Seconds until the last request of one engine finishes (all waiting at time 0)."""
    if any(n < 0 for _, n in requests):
        raise ValueError("request lengths must be >= 0")
    reqs = [SimRequest(f"{pid}/{i}", pid, n, predicted.get(pid, 0.0))
            for i, (pid, n) in enumerate(requests)]
    return simulate([reqs], slots, UnitStepper(step_seconds), policy)["makespan_s"]


def _queue(requests: List[SimRequest], policy: str) -> List[SimRequest]:
    """The waiting queue: submission order (FCFS) or longest predicted group first (LPT)."""
    if policy == "fcfs":
        return list(requests)
    if policy != "lpt":
        raise ValueError(f"policy must be 'fcfs' or 'lpt', got {policy!r}")
    predicted = {r.group: r.predicted for r in requests}
    return [requests[i] for i in lpt_group_order([r.group for r in requests], predicted)]


@dataclass
class _Engine:
    waiting: List[SimRequest]
    running: List[SimRequest] = field(default_factory=list)
    clock: float = 0.0
    busy_s: float = 0.0
    steps: int = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


def simulate(assignment: Sequence[Sequence[SimRequest]], slots: int, stepper: Stepper,
             policy: str = "fcfs", migration: Optional[Migration] = None) -> dict:
    """Run every engine's queue (``assignment[e]``, in submission order) to completion.

    Returns the makespan (the last engine's finish), per-engine busy seconds and step counts,
    the migrations made; each request's ``finish_s`` is set."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    engines = [_Engine(_queue(list(reqs), policy)) for reqs in assignment]
    migrations = 0
    while True:
        live = [e for e, eng in enumerate(engines) if not eng.idle]
        if not live:
            break
        e = min(live, key=lambda i: (engines[i].clock, i))
        eng = engines[e]
        new = []
        while len(eng.running) < slots and eng.waiting:
            req = eng.waiting.pop(0)
            if req.done >= req.length:
                req.finish_s = eng.clock
                continue
            eng.running.append(req)
            new.append(req)
        if new:
            eng.clock += stepper.admit(e, new)
        if not eng.running:
            continue
        stepper.queue(e, eng.waiting)
        seconds, emitted = stepper.step(e, eng.running)
        eng.clock += seconds
        eng.busy_s += seconds
        eng.steps += 1
        still = []
        for req, n in zip(eng.running, emitted):
            req.done = min(req.length, req.done + n)
            if req.done >= req.length:
                req.finish_s = eng.clock
                stepper.finish(e, req)
            else:
                still.append(req)
        eng.running = still
        if migration is not None:
            migrations += _migrate(engines, e, migration)
    return {"makespan_s": max((eng.clock for eng in engines), default=0.0),
            "engine_busy_s": [eng.busy_s for eng in engines],
            "engine_steps": [eng.steps for eng in engines], "migrations": migrations}


def _migrate(engines: List[_Engine], busy: int, cfg: Migration) -> int:
    """Move overrunning requests of engine ``busy`` to idle engines (see :class:`Migration`)."""
    idle = [i for i, eng in enumerate(engines) if eng.idle]
    src = engines[busy]
    load = len(src.running) + len(src.waiting)  # the driver counts every job it sent there
    if not idle or load <= 1:
        return 0
    candidates = sorted((r for r in src.running
                         if r.migrations < cfg.max_migrations
                         and r.done > cfg.overrun_factor * r.predicted
                         and r.length - r.done >= cfg.min_remaining_tokens),
                        key=lambda r: -(r.done - r.predicted))
    take = candidates[:max(1, math.ceil(load * len(idle) / (len(idle) + 1)))]
    for k, req in enumerate(take):
        dst = engines[idle[k % len(idle)]]
        src.running.remove(req)
        req.migrations += 1
        dst.waiting.append(req)
        dst.clock = max(dst.clock, src.clock)
    return len(take)


def step_curve(cost_model: dict) -> Callable[[int], float]:
    """Seconds per plain decode step vs batch size, from ``rhyme_stats()["cost_model"]``
    (seconds per request-step per power-of-two bucket, plain decode under width "0" or the
    older "plain" key; linear between measured buckets)."""
    points = sorted((int(b), v.get("0") or v.get("plain"))
                    for b, v in cost_model.get("seconds_per_request_step", {}).items()
                    if v.get("0") or v.get("plain"))
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
