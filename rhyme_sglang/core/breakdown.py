"""Where an engine's wall time goes: prefill, decode steps by kind, overheads and idle time.

:class:`TimeBreakdown` accumulates, over a window that starts at the last :meth:`reset`:

* ``prefill``: steps, seconds, tokens computed and prefix-cache hits (tokens not recomputed);
* ``decode``: per step kind (``plain``, ``verify_w<width>``): steps, seconds, requests
  (summed batch sizes), tokens emitted and rows (tokens the forwards ran: a plain step's
  batch size, a verify's tree nodes; a per-request verify runs fewer than its width's
  ``requests * (width + 1)``);
* ``draft_s`` (draft lookups, part of the decode steps' seconds), ``postprocess_s`` (result processing after
  each forward), ``schedule_s`` (between steps while requests are in flight) and ``idle_s``
  (between steps with nothing in flight);
* ``minor_faults``: the process's minor page faults in the window (pages the kernel mapped
  and zeroed on first touch; a step that keeps re-mapping its buffers shows here, see
  :mod:`rhyme_sglang.cpu_backend.malloc`);
* a timeline of steps ``[t, kind, batch_size, seconds, tokens]`` (t from the window start),
  decimated to at most ``max_steps`` entries so it stays bounded.

The engine adapter calls the ``on_*`` methods from its step loop. Standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional


def minor_faults() -> int:
    """This process's minor page faults so far (all threads; 0 where unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclass
class StepTotals:
    steps: int = 0
    seconds: float = 0.0
    requests: int = 0
    tokens: int = 0
    rows: int = 0

    def add(self, seconds: float, requests: int, tokens: int, rows: int = 0) -> None:
        self.steps += 1
        self.seconds += seconds
        self.requests += requests
        self.tokens += tokens
        self.rows += rows

    def as_dict(self, rows: bool = False) -> dict:
        out = {"steps": self.steps, "seconds": self.seconds, "requests": self.requests,
               "tokens": self.tokens,
               "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else None}
        if rows:
            out["rows"] = self.rows
        return out


def decode_kind(width: int) -> str:
    return "plain" if width == 0 else f"verify_w{width}"


class TimeBreakdown:
    def __init__(self, max_steps: int = 4096, clock: Callable[[], float] = time.perf_counter,
                 faults: Callable[[], int] = minor_faults):
        if max_steps < 2:
            raise ValueError(f"max_steps must be >= 2, got {max_steps}")
        self._clock = clock
        self._faults = faults
        self._max = max_steps
        self.reset()

    def reset(self) -> None:
        """Start a new window (the totals and the timeline restart at zero)."""
        self.start = self._clock()
        self._faults_at_start = self._faults()
        self.prefill = StepTotals()
        self.cached_tokens = 0
        self.decode: Dict[str, StepTotals] = {}
        self.draft_s = self.postprocess_s = self.schedule_s = self.idle_s = 0.0
        self._timeline: List[list] = []
        self._stride, self._skip = 1, 0
        self._last_end: Optional[float] = None
        self._busy = False

    # -------------------------------------------------------------- step loop
    def on_step_start(self, now: Optional[float] = None) -> None:
        """A forward is about to run: the gap since the last step was scheduling or idle."""
        now = self._clock() if now is None else now
        if self._last_end is not None:
            gap = max(0.0, now - self._last_end)
            if self._busy:
                self.schedule_s += gap
            else:
                self.idle_s += gap
        self._last_end = None

    def on_prefill(self, start: float, seconds: float, requests: int, tokens: int,
                   cached_tokens: int) -> None:
        self.prefill.add(seconds, requests, tokens)
        self.cached_tokens += cached_tokens
        self._record(start, "prefill", requests, seconds, tokens)

    def on_decode(self, start: float, width: int, seconds: float, requests: int,
                  tokens: int, rows: Optional[int] = None) -> None:
        """A decode step; ``rows``: the tokens its forward ran (None: ``requests * (width +
        1)``, every request at the full width)."""
        kind = decode_kind(width)
        rows = requests * (width + 1) if rows is None else rows
        self.decode.setdefault(kind, StepTotals()).add(seconds, requests, tokens, rows)
        self._record(start, kind, requests, seconds, tokens)

    def on_draft(self, seconds: float) -> None:
        self.draft_s += seconds

    def on_step_end(self, postprocess_s: float, busy: bool, now: Optional[float] = None) -> None:
        """Result processing is done; ``busy``: requests are still running or waiting."""
        self.postprocess_s += postprocess_s
        self._last_end = self._clock() if now is None else now
        self._busy = busy

    def _record(self, start: float, kind: str, requests: int, seconds: float, tokens: int) -> None:
        self._skip += 1
        if self._skip < self._stride:
            return
        self._skip = 0
        self._timeline.append([start - self.start, kind, requests, seconds, tokens])
        if len(self._timeline) >= self._max:  # halve the resolution
            self._timeline = self._timeline[::2]
            self._stride *= 2

    # -------------------------------------------------------------- report
    def as_dict(self, now: Optional[float] = None) -> dict:
        now = self._clock() if now is None else now
        window = max(0.0, now - self.start)
        forward = self.prefill.seconds + sum(t.seconds for t in self.decode.values())
        accounted = forward + self.postprocess_s + self.schedule_s + self.idle_s
        return {
            "window_s": window,
            "prefill": dict(self.prefill.as_dict(), cached_tokens=self.cached_tokens),
            "decode": {k: v.as_dict(rows=True) for k, v in sorted(self.decode.items())},
            "draft_s": self.draft_s,
            "postprocess_s": self.postprocess_s,
            "schedule_s": self.schedule_s,
            "idle_s": self.idle_s,
            "unaccounted_s": max(0.0, window - accounted),
            "minor_faults": self._faults() - self._faults_at_start,
            "timeline_stride": self._stride,
            "timeline": [list(e) for e in self._timeline],
        }
