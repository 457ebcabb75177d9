"""The CLI's progress sinks (:class:`rl_driver.progress.ProgressSink`): tqdm bars on a
terminal, plain lines anywhere else."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO, Tuple


def progress_sink(nested: bool, stream: TextIO = sys.stderr):
    """Bars when ``stream`` is a terminal, plain lines otherwise (tqdm's bars are
    carriage-return redraws: in a file they pile up on one line)."""
    return PhaseBars(nested) if stream.isatty() else PhaseLines(stream)


class PhaseBars:
    """The progress sink on a terminal: a tqdm bar per phase of an epoch (rollout requests with
    tok/s, train micro-batches, the weight sync)."""

    FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} |{bar:20}| [{elapsed}{postfix}]"

    def __init__(self, nested: bool):
        self.nested = nested  # under an epoch bar: bars on line 2, removed when done
        self._bar = None
        self._phase = ""

    def _show(self, phase: str, done: int, total: int, unit: str, postfix: str = "") -> None:
        from tqdm import tqdm

        if self._bar is None or self._phase != phase or self._bar.total != total:
            self.close()
            self._bar = tqdm(total=total, desc=f"  {phase}", unit=unit, leave=not self.nested,
                             position=1 if self.nested else None, mininterval=0.5,
                             bar_format=self.FORMAT)
            self._phase = phase
        self._bar.n = done
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()
        if done >= total:
            self.close()

    def rollout(self, done: int, total: int, tokens: int, elapsed_s: float) -> None:
        self._show("rollout", done, total, "req", _tok_s(tokens, elapsed_s))

    def train(self, done: int, total: int) -> None:
        self._show("train", done, total, "micro-batch")

    def sync(self, seconds) -> None:
        if seconds is None:
            self._show("sync", 0, 1, "step")
        else:
            self._show("sync", 1, 1, "step", f"{seconds:.1f}s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class PhaseLines:
    """The progress sink off a terminal (a file, a pipe): one plain line per phase when it
    ends (``done / total unit, figures, seconds``), and while it runs at most one every
    ``interval_s`` (default ``INTERVAL_S``)."""

    INTERVAL_S = 30.0

    def __init__(self, stream: TextIO, interval_s: Optional[float] = None, clock=time.monotonic):
        self.stream, self.clock = stream, clock
        self.interval_s = self.INTERVAL_S if interval_s is None else interval_s
        self._phase: Optional[Tuple[str, int]] = None
        self._ended = False
        self._start = self._last = 0.0

    def _show(self, phase: str, done: int, total: int, unit: str, figures: str = "") -> None:
        now, key = self.clock(), (phase, total)
        if key != self._phase or (self._ended and done < total):
            self._phase, self._ended, self._start, self._last = key, False, now, now
        elif self._ended:
            return  # the ended phase's last update again
        if done < total and now - self._last < self.interval_s:
            return
        self._last, self._ended = now, done >= total
        self._print(f"{phase}: {done}/{total} {unit}, {figures + ', ' if figures else ''}"
                    f"{now - self._start:.1f}s")

    def _print(self, text: str) -> None:
        print("  " + text, file=self.stream, flush=True)

    def rollout(self, done: int, total: int, tokens: int, elapsed_s: float) -> None:
        self._show("rollout", done, total, "requests", _tok_s(tokens, elapsed_s))

    def train(self, done: int, total: int) -> None:
        self._show("train", done, total, "micro-batches")

    def sync(self, seconds) -> None:
        if seconds is not None:  # its start has no figures to show
            self._print(f"sync: 1/1 step, {seconds:.1f}s")

    def close(self) -> None:
        self._phase = None


def _tok_s(tokens: int, elapsed_s: float) -> str:
    return f"{tokens / max(elapsed_s, 1e-9):.0f} tok/s"
