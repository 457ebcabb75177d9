"""Progress inside an epoch (rollout -> train -> sync), reported to an optional sink.

The loop calls a ``ProgressSink`` (the CLI's shows tqdm bars); library code never prints.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple


class ProgressSink(Protocol):
    def rollout(self, done: int, total: int, tokens: int, elapsed_s: float) -> None:
        """``done`` of ``total`` requests finished, ``tokens`` generated so far."""

    def train(self, done: int, total: int) -> None:
        """``done`` of ``total`` micro-batches of the GRPO step processed."""

    def sync(self, seconds: Optional[float]) -> None:
        """Weight sync started (``None``) or finished after ``seconds``."""


def wait_train(trainer, ref, sink: Optional[ProgressSink], poll_s: float = 1.0) -> Any:
    """``ray.get(ref)`` of a ``train_step``, polling ``trainer.train_progress`` meanwhile."""
    import ray

    if sink is None:
        return ray.get(ref)
    last: Tuple[int, int] = (-1, -1)
    while not ray.wait([ref], timeout=poll_s)[0]:
        try:
            now = tuple(ray.get(trainer.train_progress.remote(), timeout=poll_s * 5))
        except Exception:  # a busy or dying actor: the step's own result tells
            continue
        if now != last and now[1]:
            sink.train(*now)
            last = now
    result = ray.get(ref)
    done, total = ray.get(trainer.train_progress.remote())
    sink.train(done, total)
    return result
