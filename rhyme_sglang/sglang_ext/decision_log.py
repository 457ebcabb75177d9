"""The decision log: one JSON line per decode step, its decision against its outcome.

Enabled by ``RHYME_DECISION_LOG=path`` (:attr:`rhyme_sglang.settings.Settings.decision_log`);
disabled, the worker holds None and the step pays one ``is None`` test.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional, Sequence

from rhyme_sglang import settings
from rhyme_sglang.core.decision import Decision

logger = logging.getLogger(__name__)


class DecisionLog:
    """Appends each step's decision (width, reason, expected accepted drafts, estimated
    seconds of it and of a plain step, before this step's measurement) and its outcome
    (seconds, accepted drafts) to ``path``; stops, with a warning, when it cannot write."""

    def __init__(self, path: str):
        self.path: Optional[str] = path

    @classmethod
    def from_settings(cls) -> Optional["DecisionLog"]:
        """The process's log (None where ``RHYME_DECISION_LOG`` is unset)."""
        path = settings.settings().decision_log
        return None if path is None else cls(path)

    def record(self, cost, decision: Decision, gains: Sequence[Sequence[float]],
               contexts: Sequence[int], seconds: float, accepted: int) -> None:
        """``gains``: each request's calibrated node gains, best first (empty: no drafts)."""
        if self.path is None:
            return
        bs, width, counts = len(gains), decision.width, decision.counts
        if counts is None:
            counts = [width if g else 0 for g in gains] if width else [0] * bs
        gain, estimate = cost.predict(bs, gains, counts, contexts)
        _, plain = cost.predict(bs, gains, [0] * bs, contexts)
        line = {"pid": os.getpid(), "bs": bs, "width": width, "rows": bs + int(sum(counts)),
                "reason": decision.reason, "keys": int(sum(contexts)), "expected": round(gain, 4),
                "estimate_s": estimate, "plain_estimate_s": plain,
                "seconds": round(seconds, 6), "accepted": accepted}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            logger.warning("rhyme: cannot write the decision log %s: %s", self.path, exc)
            self.path = None
