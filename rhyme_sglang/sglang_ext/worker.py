"""RhymeWorker: sglang's NGRAM verify path with drafts from the per-prompt history store.

Subclasses :class:`NGRAMWorker` and replaces only the draft source
(``_prepare_draft_tokens``) and the corpus update (``_update_ngram_corpus``); verification,
KV bookkeeping and logprobs stay sglang's (lossless on GPU through sglang's kernels, on CPU
through :mod:`rhyme_sglang.cpu_backend`). Requests are keyed by prompt automatically (hash of
the prompt ids) or by ``custom_params["rhyme_prompt_id"]``; finished responses join the
history (:meth:`RhymeWorker.on_finished`); the epoch advances after a weight update.

A decode step reads plan -> run -> observe (:meth:`RhymeWorker.forward_batch_generation`):
the plan drafts and asks the width policy (the cost model's :meth:`SpecCostModel.decide`, or
the test-only :class:`CycleWidths`) for plain decode or a verify; the run is sglang's; the
observation feeds the step's seconds and outcome back. With ``ragged`` (the default on CPU)
each request of a verify gets its own number of draft nodes; sglang's verify keeps its
``[bs, n]`` layout (``n`` = the largest request's nodes) and only the forward is ragged
(:func:`step_kinds.ragged_verify`). Without it (GPU, overlap scheduling, ``ragged=False``)
the width is per step for the whole batch, each request padded to it.

Who owns what: :class:`RequestTable` the requests in flight, :class:`Scheduling` the waiting
queue's order and group prefill, :class:`DecisionLog` the optional per-step log,
:class:`ControlCommands` the control commands. Thread-safety: the scheduler thread and the
control thread both take ``self.lock``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from sglang.srt.speculative.ngram_worker import NGRAMWorker

from rhyme_sglang.core import DraftStore
from rhyme_sglang.core.breakdown import decode_kind
from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel, check_widths, default_widths
from rhyme_sglang.core.decision import Decision
from rhyme_sglang.core.draft import Draft, best_first_order, expected_accepts, truncate
from rhyme_sglang.core.draft_rest import DraftRest
from rhyme_sglang.core.health import SpecHealth
from rhyme_sglang.core.requests import RequestTable
from rhyme_sglang.core.width_cycle import CycleWidths
from rhyme_sglang.sglang_ext import step_kinds, timeline
from rhyme_sglang.sglang_ext.commands import ControlCommands
from rhyme_sglang.sglang_ext.config import RhymeConfig
from rhyme_sglang.sglang_ext.decision_log import DecisionLog
from rhyme_sglang.sglang_ext.scheduling import Scheduling
from rhyme_sglang.sglang_ext.stats import SpecStats
from rhyme_sglang.sglang_ext.step_costs import StepCostCache
from rhyme_sglang.sglang_ext.tree_layout import draft_to_tree
from rhyme_sglang.sglang_ext.validation import custom_param, is_run_ahead

logger = logging.getLogger(__name__)
ACTIVE_WORKERS: list = []  # the RhymeWorker of this scheduler process (hooks find it here)


def path_dependent_penalties(req) -> bool:
    """Whether ``req``'s logits at a tree node depend on the draft tokens above that node:
    frequency, presence or repetition penalties, or a ``min_new_tokens`` not reached yet.
    sglang's verify applies the penalties accumulated before the step to every node of the
    tree ("a relaxed version of penalties"), so such a request gets no drafts: its verify row
    is its root, penalised exactly as in a plain step."""
    params = req.sampling_params
    return bool(params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
                or params.repetition_penalty != 1.0
                or len(req.output_ids) < (params.min_new_tokens or 0))


def _accepted(result, bs: int) -> int:
    """Draft tokens a verify step's ``result`` accepted over its ``bs`` requests."""
    lens = getattr(result, "accept_lens", None)
    return 0 if lens is None else int(lens.sum().item()) - bs


def _contexts(batch) -> list:
    """Each request's context tokens in a decode batch (its sequence length)."""
    lens = batch.seq_lens_cpu if getattr(batch, "seq_lens_cpu", None) is not None else batch.seq_lens
    return lens.tolist()


def track(requests: RequestTable, req) -> None:
    """Start tracking the scheduler request ``req`` (and its store request) if new."""
    if req.rid not in requests:
        requests.start(req.rid, req.origin_input_ids_unpadded,
                       prompt_id=custom_param(req, "rhyme_prompt_id"),
                       sample=custom_param(req, "rhyme_sample"), run_ahead=is_run_ahead(req))


def finish_finished(requests: RequestTable, reqs) -> None:
    """Finished requests among ``reqs`` join the history, once each (called before sglang
    streams their output and after it processed their batch). A verify step may accept
    tokens past a stop or max_new_tokens: sglang keeps them in ``output_ids`` and returns only
    those through the stop; so does the history. An aborted request's response does not join,
    except a run-ahead request's: finished or aborted, its tokens join as a draft-only record
    (an aborted one only from ``run_ahead_min_tokens`` tokens on)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in reqs:
        if req.finished() and not getattr(req, "_rhyme_finished", False):
            req._rhyme_finished = True
            track(requests, req)
            aborted = isinstance(req.finished_reason, FINISH_ABORT)
            requests.finish(req.rid, req.output_ids_through_stop,
                            add_to_history=not aborted or is_run_ahead(req), truncated=aborted)


@dataclass
class _Step:
    """One decode step's plan, and when it was decided."""

    decision: Decision
    drafts: Optional[list]  # each request's draft (None: the step did not draft)
    contexts: list  # each request's context tokens (attention's cost grows with them)
    lens: Optional[List[int]]  # a ragged verify's tree nodes per request
    decided: float  # perf_counter when the plan was made

    @property
    def rows(self) -> Optional[int]:
        """A ragged verify's forward rows (None otherwise)."""
        return None if self.lens is None else sum(self.lens)


class RhymeWorker(ControlCommands, NGRAMWorker):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.config = RhymeConfig.from_env()
        self.lock = threading.RLock()
        self.store = DraftStore(self.config.store_config())
        self.stats = SpecStats()
        self.max_width = self.draft_token_num - 1
        self.widths = (check_widths(self.config.widths, self.max_width) if self.config.widths
                       else default_widths(self.max_width))
        self.cost = SpecCostModel(widths=self.widths)
        self.rest = DraftRest()  # plain steps that skip drafting after clear losses
        self.health = SpecHealth()
        self._warm_widths = set()  # widths whose first step (warm-up, not a cost) has run
        self._decode_steps = 0
        self._checked = True  # check_integrity ran since the last decode step
        # per-request widths need the synchronous scheduler and the CPU backend's ragged
        # attention metadata (cpu_backend/patches.py)
        self.ragged = bool(self.config.ragged and not self.enable_overlap
                           and str(self.device).startswith("cpu"))
        self.cycle = CycleWidths(self.widths, self.ragged) if self.config.cycle_widths else None
        self.step_costs = None  # saved step costs: a warm cost model across engine starts
        if self.config.cost_cache and self.config.adaptive and self.cycle is None:
            self.step_costs = StepCostCache.for_engine(server_args, target_worker.model_runner)
            self.step_costs.seed(self.cost)
        self._pending_drafts = None  # drafts made while deciding, reused by the verify step
        self._last_decision = Decision(PLAIN)  # the cost model's last: are probes wanted
        self.requests = RequestTable(self.store, self.cost, self.stats,
                                     self.config.request_calibration)
        self.scheduling = Scheduling(self.store, self.stats, self.config, self.lock)
        self._weights_changed = False
        self.decision_log = DecisionLog.from_settings()
        if self.config.snapshot_path and os.path.exists(self.config.snapshot_path):
            self.store.load(self.config.snapshot_path)
            logger.info("rhyme: loaded history snapshot %s", self.config.snapshot_path)
        ACTIVE_WORKERS[:] = [self]
        self.control = None
        if self.config.control_addr:
            from rhyme_sglang.sglang_ext.control import ControlServer

            self.control = ControlServer(self.config.control_addr, self)
            self.control.start()

    # ------------------------------------------------------------ the step
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        """One step: prefill, or a decode step planned (plain or a verify), run, observed."""
        if not batch.forward_mode.is_decode():
            return super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)
        step = self._plan(batch)
        result = self._run(batch, step, on_publish, pp_proxy_tensors)
        self._observe(batch, step, result)
        return result

    def _plan(self, batch) -> _Step:
        """Draft (unless resting) and decide the step's width; lay out a verify's trees."""
        t0 = time.perf_counter()
        contexts = _contexts(batch)
        # the cost model picks the width (not a fixed or cycled one): drafting may rest
        learned = self._widths_vary(batch) and self.cycle is None
        drafts = None
        if self._plain_only(batch) or (learned and self._resting(batch)):
            decision = Decision(PLAIN, reason="rest")
            if learned:
                self.cost.probes.tick(len(batch.reqs))  # resting steps count toward the next probe
        else:
            drafts = self._draft_batch(batch)
            decision = self._decide(batch, drafts, contexts)
            if learned:
                self._last_decision = decision
                self.rest.decided(decision.width, decision.advantage)
        lens = None
        decided = time.perf_counter()
        if decision.width:
            tokens, masks, lens = self._layout(batch, drafts, decision.width, decision.counts)
            self._pending_drafts = tokens, masks
        step = _Step(decision, drafts, contexts, lens, decided)
        timeline.note_width(decision.width, step.rows)
        timeline.BREAKDOWN.on_draft(time.perf_counter() - t0)
        return step

    def _run(self, batch, step: _Step, on_publish, pp_proxy_tensors):
        """sglang's plain decode, or its verify at the step's tree size."""
        width = step.decision.width
        if width == PLAIN:
            return step_kinds.plain_decode(self, batch, on_publish)
        nodes = width + 1 if step.lens is None else max(step.lens)  # a ragged verify's tree size
        with step_kinds.verify_width(self, nodes), step_kinds.ragged_verify(self, step.lens):
            return super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)

    def _observe(self, batch, step: _Step, result) -> None:
        """The step's seconds (a verify's include its tree layout) and outcome go to the cost
        model, the probe clock, the decision log, the stats and the health check."""
        seconds = time.perf_counter() - step.decided
        bs, decision = len(batch.reqs), step.decision
        width = decision.width
        if width and decision.reason == "probe":
            self.cost.probes.outcome(bs, _accepted(result, bs), decision.probe_predicted)
        if self.decision_log is not None:
            gains = ([[] for _ in range(bs)] if step.drafts is None
                     else self._node_gains(batch, step.drafts))
            self.decision_log.record(self.cost, decision, gains, step.contexts, seconds,
                                     _accepted(result, bs) if width else 0)
        if width in self._warm_widths:
            self.cost.observe_step(bs, width, seconds, step.rows, step.contexts, step.lens)
            if self.step_costs is not None:
                self.step_costs.observed(self.cost)
        else:  # a width's first step in this process pays one-off set-up: not its cost
            self._warm_widths.add(width)
            if width:
                self.cost.probes.verified(bs)
        self.stats.count_step(decode_kind(width))
        self._record_health(step.drafts, width)
        self._checked = False

    def _record_health(self, drafts, width: int) -> None:
        """Feed the step to :class:`SpecHealth` (every 256 steps it also judges, so a cause
        is logged when it arises, not only when stats are read)."""
        predicted = () if drafts is None else [sum(d.probs) for d in drafts]
        self.health.record(predicted, width != PLAIN)
        self._decode_steps += 1
        if self._decode_steps % 256 == 0:
            self.health.report(self.cost.calibration_at_bound())

    # ------------------------------------------------------------ the decision
    def _widths_vary(self, batch) -> bool:
        """Whether this step may take any width (else the largest: GPU overlap scheduling
        relays the last step's tokens with a fixed stride; grammar batches; ``adaptive=False``)."""
        return bool(self.config.adaptive and not self.enable_overlap and not batch.has_grammar)

    def _plain_only(self, batch) -> bool:
        """Whether this step must be plain whatever the width settings: sglang's verify does
        not run custom logit processors (its sampler does), so a batch with one decodes plain
        where plain steps can run (the synchronous scheduler, no grammar)."""
        info = batch.sampling_info
        return bool(not self.enable_overlap and not batch.has_grammar
                    and info is not None and info.has_custom_logit_processor)

    def _resting(self, batch) -> bool:
        """Whether this step is plain without drafting (:class:`DraftRest`); a request not
        tracked yet, or a probe wanted at this batch size, ends the rest."""
        with self.lock:
            new = any(req.rid not in self.requests for req in batch.reqs)
        probe = self._last_decision.promising and self.cost.probes.due(len(batch.reqs))
        return self.rest.resting(new or probe)

    def _decide(self, batch, drafts, contexts) -> Decision:
        """The step's :class:`Decision`: the largest width when widths may not vary
        (:meth:`_widths_vary`), the cycle's with ``cycle_widths``, else the cost model's, per
        request (``ragged``) or per step."""
        bs = len(batch.reqs)
        if not self._widths_vary(batch):
            return Decision(self.max_width, reason="fixed")
        if self.cycle is not None:
            return self.cycle.decide(bs)
        horizon = self.scheduling.horizon(batch.reqs) if self.config.horizon else None
        if self.ragged:
            raw = [[d.probs[i] for i in best_first_order(d)] for d in drafts]
            return self.cost.decide(bs, gains=self._node_gains(batch, drafts, raw),
                                    horizon=horizon, contexts=contexts, raw=raw)
        per_request = [expected_accepts(d, self.widths) for d in drafts]
        factors = [self.requests.evidence_factor(r.rid) for r in batch.reqs]
        if horizon is not None and horizon.background:  # never verified: no expected gain
            per_request = [r if horizon.foreground(i) else {} for i, r in enumerate(per_request)]
        critical = None if horizon is None else \
            self.cost.critical_expected(per_request, horizon, factors)
        expected = self.cost.batch_expected(per_request, factors)
        raw = {w: sum(r.get(w, 0.0) for r in per_request) for w in self.widths}
        return self.cost.decide(bs, expected=expected, calibrated=True, horizon=horizon,
                                critical=critical, contexts=contexts, raw=raw)

    def _node_gains(self, batch, drafts, raw=None) -> list:
        """Each request's calibrated node gains, best first (``raw``: their path
        probabilities in that order, computed when not given)."""
        if raw is None:
            raw = [[d.probs[i] for i in best_first_order(d)] for d in drafts]
        return [self.cost.node_gains(p, self.requests.evidence_factor(r.rid))
                for p, r in zip(raw, batch.reqs)]

    # ------------------------------------------------------------ draft source
    def _prepare_draft_tokens(self, batch):
        pending, self._pending_drafts = self._pending_drafts, None
        if pending is None:  # a verify step not prepared by forward_batch_generation
            # no ragged forward around this one: every request gets n nodes, padding computed
            tokens, masks, _ = self._layout(batch, self._draft_batch(batch),
                                            self.draft_token_num - 1, ragged=False)
            pending = tokens, masks
        return pending

    def _draft_batch(self, batch) -> list:
        """Sync the store with each request's output, then draft up to the largest width."""
        bs, n = len(batch.reqs), self.draft_token_num
        use_prev = self.enable_overlap and not batch.grammar_needs_sync()
        prev_tokens, prev_lens = [], [0] * bs
        if use_prev:
            prev_tokens = batch.spec_info.accept_tokens.cpu().tolist()
            prev_lens = batch.spec_info.accept_lens.cpu().tolist()
        self.prev_token_ids, self.prev_accept_lens = prev_tokens, prev_lens
        drafts = []
        with self.lock:
            self._maybe_advance_epoch()
            for i, req in enumerate(batch.reqs):
                extra = prev_tokens[i * n : i * n + prev_lens[i]] if use_prev else []
                self._sync(req, req.output_ids, extra)
                if path_dependent_penalties(req):
                    drafts.append(Draft())  # verified at its root only: a plain step's token
                else:
                    t0 = time.perf_counter()
                    drafts.append(self.store.speculate(req.rid, self.max_width))
                    self.stats.record_lookup((time.perf_counter() - t0) * 1e6)
                if extra:
                    self.requests.hold_last(req.rid, extra[-1])
        return drafts

    def _layout(self, batch, drafts, width: int, counts=None, ragged=None):
        """sglang's verify tree (flat tokens, flat ancestor masks) of each request's ``width``
        (or ``counts[i]``) most probable draft nodes, and each request's real nodes (None:
        every request runs all ``width + 1``); records what each request proposed. Ragged
        (``self.ragged`` unless ``ragged`` says otherwise): the trees are cut to the largest
        request's nodes, for :func:`step_kinds.ragged_verify`."""
        bs, n = len(batch.reqs), width + 1
        lens = [n] * bs
        tokens = np.empty((bs, n), dtype=np.int64)
        masks = np.empty((bs, n, n), dtype=bool)
        with self.lock:
            for i, (req, draft) in enumerate(zip(batch.reqs, drafts)):
                last = self.requests.take_last(req.rid)
                if last is None:
                    out_ids = req.output_ids
                    last = out_ids[-1] if len(out_ids) else req.origin_input_ids_unpadded[-1]
                whole = float(sum(draft.probs))  # the prediction its per-request gains were scaled at
                draft = truncate(draft, width if counts is None else min(counts[i], width))
                tokens[i], masks[i], real = draft_to_tree(last, draft.token_ids, draft.parents, n)
                predicted = float(sum(draft.probs[:real]))
                self.requests.propose(req.rid, real, predicted, whole if self.ragged else predicted)
                lens[i] = real + 1
        if not (self.ragged if ragged is None else ragged):
            return tokens.reshape(-1), masks.reshape(-1), None
        n = max(lens)  # padding comes last: drop the nodes no request reaches
        return tokens[:, :n].reshape(-1), masks[:, :n, :n].reshape(-1), lens

    def _update_ngram_corpus(self, batch):
        """Accepted tokens reach the store at the next draft (or at finish), not here."""

    def _sync(self, req, out_ids, extra=()) -> None:
        """Track ``req`` if new, then feed the store its new output tokens."""
        track(self.requests, req)
        self.requests.sync(req.rid, out_ids, extra)

    # --------------------------------------------------------- request lifecycle
    def on_finished(self, reqs) -> None:
        """Finished requests among ``reqs`` join the history (:func:`finish_finished`)."""
        with self.lock:
            finish_finished(self.requests, reqs)

    def note_weights_updated(self) -> None:
        with self.lock:
            self._weights_changed = True

    def _maybe_advance_epoch(self) -> None:
        if self._weights_changed:
            self._weights_changed = False
            epoch = self.advance_epoch()
            logger.info("rhyme: weights changed, history epoch -> %d", epoch)

    def advance_epoch(self) -> int:
        """The next history epoch; the acceptance evidence of the last one counts half
        (:meth:`SpecCostModel.forget_acceptance`). The caller holds the lock."""
        self.cost.forget_acceptance()
        return self.store.advance_epoch()

    def check_integrity(self) -> None:
        """Check the request table, the probe clocks and the store, once per idle period
        (the scheduler calls it when idle; not for the hot loop). Raises AssertionError."""
        if self._checked:
            return
        with self.lock:
            self.requests.check_integrity()
            self.cost.probes.check_integrity()
            if not self.store.check_integrity():
                raise AssertionError("rhyme: the draft store failed its integrity check")
        self._checked = True
