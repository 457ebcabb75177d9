"""A test-only width policy: every ordered pair of step kinds in turn, whatever they cost.

With ``cycle_widths`` the worker's steps run plain and every verify width in every order, so
a lossless test sees each kind follow each other kind. With ``ragged``, every other verify
step gives request ``i`` ``(i + step) % (width + 1)`` draft nodes (0 included).

Standard library and core only.
"""

from __future__ import annotations

from typing import Tuple

from rhyme_sglang.core.decision import Decision
from rhyme_sglang.core.step_table import PLAIN


class CycleWidths:
    """Decides each step's width from a fixed cycle (``decide`` as :class:`SpecCostModel`)."""

    def __init__(self, widths: Tuple[int, ...], ragged: bool):
        kinds = (PLAIN,) + tuple(widths)
        self._cycle = [x for a in kinds for b in kinds for x in (a, b)]
        self._step = -1
        self.ragged = ragged

    def decide(self, batch_size: int) -> Decision:
        self._step += 1
        width = self._cycle[self._step % len(self._cycle)]
        if not (self.ragged and width and self._step % 2):
            return Decision(width, reason="cycle")
        return Decision(width, [(i + self._step) % (width + 1) for i in range(batch_size)],
                        reason="cycle")
