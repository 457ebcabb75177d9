"""Steps and epochs over a prompt dataset: which prompts each training step samples.

An epoch is one pass over the dataset's ``P`` prompts in an order shuffled by
``random.Random(seed + epoch)`` (as verl and OpenRLHF seed their samplers); its steps take
``per_step`` prompts each in that order (the last step of an epoch may be smaller), and each
step is one GRPO update and one weight sync. ``per_step == 0`` (or ``>= P``) is one step per
epoch over all prompts in dataset order. A global step ``s`` numbers steps across epochs, so
the policy that rolls out step ``s`` has had ``s`` updates; a prompt revisited at step ``s``
after its last visit at step ``t`` comes back after ``s - t`` updates.
"""

from __future__ import annotations

import math
import random
from typing import Dict, List, NamedTuple, Optional, Sequence


class Step(NamedTuple):
    """One training step: its place in the run and the prompts it samples."""

    step: int  # global step (0-based, across epochs)
    epoch: int
    step_in_epoch: int
    prompt_ids: List[str]


class Visit(NamedTuple):
    """How a step's prompts were seen before: ``kind`` is "first" (none was), "revisit" (all
    were) or "mixed"; ``updates`` holds, per revisited prompt, the policy updates since its
    last visit."""

    kind: str
    updates: Dict[str, int]

    def summary(self) -> Dict[str, object]:
        """Metrics keys: ``visit``, ``updates_since_last_visit`` (mean over revisited
        prompts, None without any) and its ``_min`` / ``_max``."""
        vals = list(self.updates.values())
        return {"visit": self.kind,
                "updates_since_last_visit": sum(vals) / len(vals) if vals else None,
                "updates_since_last_visit_min": min(vals) if vals else None,
                "updates_since_last_visit_max": max(vals) if vals else None}


class StepSampler:
    """The steps of a run over ``prompt_ids`` (unique, dataset order), ``per_step`` prompts a
    step (0 = all), shuffled per epoch by ``seed``."""

    def __init__(self, prompt_ids: Sequence[str], per_step: int, seed: int):
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("a step sampler needs at least one prompt, got none")
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique, got {len(ids) - len(set(ids))} duplicates")
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 0:
            raise ValueError(f"per_step must be an int >= 0, got {per_step!r}")
        self.prompt_ids = ids
        self.per_step = per_step if 0 < per_step < len(ids) else len(ids)
        self.shuffle = 0 < per_step < len(ids)
        self.seed = seed
        self.steps_per_epoch = math.ceil(len(ids) / self.per_step)
        self._orders: Dict[int, List[str]] = {}
        self._positions: Dict[int, Dict[str, int]] = {}

    def order(self, epoch: int) -> List[str]:
        """The epoch's prompt order (dataset order when every step takes all prompts)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch not in self._orders:
            ids = list(self.prompt_ids)
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(ids)
            self._orders[epoch] = ids
            if len(self._orders) > 4:  # steps are asked in order: keep the recent epochs
                del self._orders[min(self._orders)]
        return self._orders[epoch]

    def step(self, s: int) -> Step:
        """Global step ``s``."""
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"step must be an int >= 0, got {s!r}")
        epoch, k = divmod(s, self.steps_per_epoch)
        ids = self.order(epoch)[k * self.per_step:(k + 1) * self.per_step]
        return Step(s, epoch, k, ids)

    def step_of(self, prompt_id: str, epoch: int) -> int:
        """The global step of ``epoch`` that samples ``prompt_id``."""
        if epoch not in self._positions:
            self._positions[epoch] = {pid: i for i, pid in enumerate(self.order(epoch))}
            if len(self._positions) > 4:
                del self._positions[min(self._positions)]
        pos = self._positions[epoch].get(prompt_id)
        if pos is None:
            raise ValueError(f"prompt {prompt_id!r} is not in the dataset")
        return epoch * self.steps_per_epoch + pos // self.per_step

    def last_visit(self, prompt_id: str, before: int) -> Optional[int]:
        """The last global step before ``before`` that sampled ``prompt_id`` (None if none):
        every prompt is sampled once per epoch, so it lies in this epoch or the previous."""
        epoch = before // self.steps_per_epoch
        for e in (epoch, epoch - 1):
            if e >= 0 and self.step_of(prompt_id, e) < before:
                return self.step_of(prompt_id, e)
        return None

    def visit(self, s: int) -> Visit:
        """How step ``s``'s prompts were seen before (the policy has one update per step)."""
        updates = {}
        for pid in self.step(s).prompt_ids:
            last = self.last_visit(pid, s)
            if last is not None:
                updates[pid] = s - last
        n = len(self.step(s).prompt_ids)
        kind = "first" if not updates else "revisit" if len(updates) == n else "mixed"
        return Visit(kind, updates)
