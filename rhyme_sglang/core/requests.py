"""The requests in flight: what each gave the draft store and what its last verify proposed.

:class:`RequestTable` owns the store's request lifecycle for an engine adapter
(``start`` -> ``sync`` after each step -> ``finish``) and turns each verify's outcome into
evidence: the store's acceptance statistics, the cost model's calibration and, with
``request_calibration``, the request's own :class:`RequestEvidence`.

Standard library only (the store and cost model are passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

from rhyme_sglang.core.calibration import RequestEvidence


@dataclass
class Tracked:
    """One request in flight."""

    synced: int = 0  # output tokens already given to the store
    proposed: Optional[int] = None  # real draft tokens of the last verify step
    predicted: float = 0.0  # the store's expected accepted drafts for that step
    level: float = 0.0  # the prediction its decision was calibrated at (calibration level)
    # with request_calibration: the calibration's expectation for that step, and the
    # request's own verifies against it
    expected: float = 0.0
    evidence: RequestEvidence = field(default_factory=RequestEvidence)
    last: Optional[int] = None  # overlap mode: the last accepted token, not yet in output_ids


class RequestTable:
    """Requests in flight by id, over a draft ``store`` (``start_request`` / ``add_tokens`` /
    ``record_acceptance`` / ``finish_request``), a cost model (``observe_acceptance``,
    ``expected_at``) and optional ``stats`` (``record(epoch, proposed, emitted)``). The
    caller serialises calls (the worker's lock)."""

    def __init__(self, store, cost, stats=None, request_calibration: bool = False):
        self.store, self.cost, self.stats = store, cost, stats
        self.request_calibration = request_calibration
        self._tracked: Dict[str, Tracked] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def get(self, rid: str) -> Optional[Tracked]:
        return self._tracked.get(rid)

    def start(self, rid: str, prompt: Sequence[int], prompt_id: Optional[str] = None,
              sample: Optional[int] = None, run_ahead: bool = False) -> Tracked:
        """Begin tracking ``rid`` (and start it in the store; ``run_ahead``: its response is a
        draft-only record). Raises ValueError if tracked."""
        if rid in self._tracked:
            raise ValueError(f"request {rid!r} already tracked")
        self.store.start_request(rid, list(prompt), prompt_id=prompt_id, sample=sample,
                                 run_ahead=run_ahead)
        tracked = self._tracked[rid] = Tracked()
        return tracked

    def sync(self, rid: str, out_ids: Sequence[int], extra: Sequence[int] = ()) -> None:
        """Feed the store ``rid``'s new output tokens: those of ``out_ids + extra`` past what
        was synced (only that tail is copied). After a verify, its accepted drafts become
        evidence (module docstring). Call after each step and before :meth:`finish`."""
        tracked = self._tracked[rid]
        done, base = tracked.synced, len(out_ids)
        new = (list(out_ids[done:]) + list(extra)) if done <= base else list(extra[done - base:])
        if not new:
            return
        self.store.add_tokens(rid, new)
        if tracked.proposed is not None:
            accepted = min(len(new) - 1, tracked.proposed)
            self.store.record_acceptance(rid, tracked.proposed, accepted)
            if self.stats is not None:
                self.stats.record(self.store.epoch, tracked.proposed, len(new))
            self.cost.observe_acceptance(tracked.predicted, accepted, tracked.level)
            if self.request_calibration:
                tracked.evidence.observe(tracked.expected, accepted, len(new))
            tracked.proposed = None
        elif self.request_calibration:
            tracked.evidence.advance(len(new))
        tracked.synced = base + len(extra)

    def propose(self, rid: str, proposed: int, predicted: float, level: float) -> None:
        """``rid``'s verify this step runs ``proposed`` real draft nodes that the store
        predicts ``predicted`` accepted, decided at calibration ``level``."""
        tracked = self._tracked[rid]
        tracked.proposed, tracked.predicted, tracked.level = proposed, predicted, level
        if self.request_calibration:  # what its evidence is measured against
            tracked.expected = self.cost.expected_at(predicted, level)

    def hold_last(self, rid: str, token: int) -> None:
        """Overlap mode: ``rid``'s last accepted token, not yet in its output ids."""
        self._tracked[rid].last = token

    def take_last(self, rid: str) -> Optional[int]:
        """The token :meth:`hold_last` kept for ``rid`` (None if none), forgotten after."""
        tracked = self._tracked[rid]
        last, tracked.last = tracked.last, None
        return last

    def evidence_factor(self, rid: str) -> float:
        """What ``rid``'s own recent verifies accepted over what the calibration expected
        (:class:`RequestEvidence`; 1 with ``request_calibration`` off or no evidence yet)."""
        if not self.request_calibration:
            return 1.0
        tracked = self._tracked.get(rid)
        return 1.0 if tracked is None else tracked.evidence.factor()

    def finish(self, rid: str, out_ids: Sequence[int], add_to_history: bool,
               truncated: bool = False) -> None:
        """Sync ``rid``'s final ``out_ids``, finish it in the store (its response joins the
        history unless ``add_to_history`` is False; ``truncated``: it was aborted) and stop
        tracking it. ``rid`` must have been started (a request that finishes at prefill is
        started then finished)."""
        self.sync(rid, out_ids)
        self.store.finish_request(rid, add_to_history=add_to_history, truncated=truncated)
        del self._tracked[rid]

    def check_integrity(self) -> None:
        """Raise AssertionError unless every tracked request is active in the store and its
        counters are in range (not for the hot loop)."""
        active = set(self.store.active_requests)
        for rid, t in self._tracked.items():
            if rid not in active:
                raise AssertionError(f"request {rid!r} is tracked but not active in the store")
            if t.synced < 0 or (t.proposed is not None and t.proposed < 0):
                raise AssertionError(f"request {rid!r} has counters out of range: {t}")
