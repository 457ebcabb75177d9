"""RhymeWorker: sglang's NGRAM verify path with drafts from the per-prompt history store.

Subclasses :class:`NGRAMWorker` and replaces only the draft source
(``_prepare_draft_tokens``) and the corpus update (``_update_ngram_corpus``); verification,
KV bookkeeping and logprobs stay sglang's (lossless on GPU through sglang's kernels, on CPU
through :mod:`rhyme_sglang.cpu_backend`). Requests are keyed by prompt automatically (hash of
the prompt ids) or by ``custom_params["rhyme_prompt_id"]``; finished responses join the
history (see :func:`on_batch_result`); the epoch advances after a weight update.

Each decode step is a plain decode or a verify, chosen by the cost model. With ``ragged``
(the default on CPU) each request of a verify gets its own width: the cost model takes the
batch's most probable draft nodes wherever they are (``SpecCostModel.decide``), so a
request with worthless drafts adds no rows to the step's forward. sglang's verify keeps its
``[bs, n]`` layout (``n`` = the largest request's width + 1) and only the forward is ragged
(:func:`step_kinds.ragged_verify`). Without it (GPU, overlap scheduling, ``ragged=False``)
the width is per step for the whole batch, each request padded to it.

Thread-safety: the scheduler thread and the control thread both take ``self.lock``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sglang.srt.speculative.ngram_worker import NGRAMWorker

from rhyme_sglang.core import DraftStore, group_leaders, lpt_group_order, prompt_key
from rhyme_sglang.core.ordering import MIN_SHARED
from rhyme_sglang.core.breakdown import decode_kind
from rhyme_sglang.core.calibration import RequestEvidence
from rhyme_sglang.core.cost_model import PLAIN, Decision, SpecCostModel, check_widths, default_widths
from rhyme_sglang.core.draft_rest import DraftRest
from rhyme_sglang.core.health import SpecHealth
from rhyme_sglang.core.horizon import Horizon, remaining_tokens
from rhyme_sglang.core.draft import Draft, best_first_order, expected_accepts, truncate
from rhyme_sglang.sglang_ext import step_kinds, timeline
from rhyme_sglang.sglang_ext.commands import ControlCommands
from rhyme_sglang.sglang_ext.config import RhymeConfig
from rhyme_sglang.sglang_ext.stats import SpecStats
from rhyme_sglang.sglang_ext.step_costs import StepCostCache
from rhyme_sglang.sglang_ext.tree_layout import draft_to_tree
from rhyme_sglang.sglang_ext.validation import check_rhyme_params

logger = logging.getLogger(__name__)
DECISION_LOG_ENV = "RHYME_DECISION_LOG"
ACTIVE_WORKERS: list = []  # the RhymeWorker of this scheduler process (hooks find it here)


@dataclass
class _Tracked:
    synced: int = 0  # output tokens already given to the store
    proposed: Optional[int] = None  # real draft tokens of the last verify step
    predicted: float = 0.0  # the store's expected accepted drafts for that step
    level: float = 0.0  # the prediction its decision was calibrated at (calibration level)
    # with request_calibration: the calibration's expectation for that step, and the
    # request's own verifies against it
    expected: float = 0.0
    evidence: RequestEvidence = field(default_factory=RequestEvidence)
    last: Optional[int] = None  # overlap mode: the last accepted token, not yet in output_ids


def _custom(req, key):
    """A RHYME custom parameter of the request, None when absent or malformed (requests are
    validated before they reach the scheduler; this keeps a bad value from stopping it)."""
    params = getattr(req.sampling_params, "custom_params", None)
    value = params.get(key) if isinstance(params, dict) else None
    try:
        check_rhyme_params({"custom_params": {key: value}})
    except ValueError:
        return None
    return value


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


def _prompt_cached(tree_cache, req) -> bool:
    """Whether the prefix cache holds ``req``'s prompt but for fewer than ``MIN_SHARED``
    tokens. Asked once per request (kept on it): a prompt cached when its group arrived
    stays worth sharing from, and a group that starts prefilling is running from then on."""
    cached = getattr(req, "_rhyme_prompt_cached", None)
    if cached is None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.common import _req_radix_key

        prompt = req.origin_input_ids
        key = _req_radix_key(tree_cache, req, prompt, max(len(prompt) - 1, 0))
        hit = tree_cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
        cached = req._rhyme_prompt_cached = len(prompt) - hit < MIN_SHARED
    return cached


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
        self.step_costs = None  # saved step costs: a warm cost model across engine starts
        if self.config.cost_cache and self.config.adaptive and not self.config.cycle_widths:
            self.step_costs = StepCostCache.for_engine(server_args, target_worker.model_runner)
            self.step_costs.seed(self.cost)
        kinds = (PLAIN,) + self.widths  # cycle_widths: every ordered pair (a, b) in turn
        self._cycle, self._cycle_step = [x for a in kinds for b in kinds for x in (a, b)], -1
        self._pending_drafts = None  # drafts made while deciding, reused by the verify step
        self._last_decision = Decision(PLAIN)  # the cost model's last: are probes wanted
        # per-request widths need the synchronous scheduler and the CPU backend's ragged
        # attention metadata (cpu_backend/patches.py)
        self.ragged = bool(self.config.ragged and not self.enable_overlap
                           and str(self.device).startswith("cpu"))
        self._tracked: dict[str, _Tracked] = {}
        self._weights_changed = False
        self._queued = 0.0  # the waiting queue's predicted tokens at the last scheduling pass
        # RHYME_DECISION_LOG=path: one JSON line per decode step, its decision against its outcome
        self._decision_log = os.environ.get(DECISION_LOG_ENV) or None
        if self.config.snapshot_path:
            if os.path.exists(self.config.snapshot_path):
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
        """One step: prefill, or a decode step at the width the cost model picks (0 = plain)."""
        if not batch.forward_mode.is_decode():
            return super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)
        bs = len(batch.reqs)
        t0 = time.perf_counter()
        contexts = _contexts(batch)  # attention's cost grows with them (core/context_fit.py)
        # the cost model picks the width (not a fixed or cycled one): drafting may rest
        learned = self._widths_vary(batch) and not self.config.cycle_widths
        drafts = None
        if self._plain_only(batch) or (learned and self._resting(batch)):
            decision = Decision(PLAIN, reason="rest")
            if learned:
                self.cost.probes.tick(bs)  # resting steps count toward the next probe
        else:
            drafts = self._draft_batch(batch)
            decision = self._choose_width(batch, drafts, contexts)
            if learned:
                self._last_decision = decision
                self.rest.decided(decision.width, decision.advantage)
        width, counts = decision.width, decision.counts
        lens = None  # a ragged verify: each request's tree nodes
        decided = time.perf_counter()
        if width:
            tokens, masks, lens = self._layout(batch, drafts, width, counts)
            self._pending_drafts = tokens, masks
        rows = None if lens is None else sum(lens)  # a ragged verify's forward rows
        timeline.note_width(width, rows)
        timeline.BREAKDOWN.on_draft(time.perf_counter() - t0)
        if width == PLAIN:
            result = step_kinds.plain_decode(self, batch, on_publish)
        else:
            nodes = width + 1 if lens is None else max(lens)  # a ragged verify's tree size
            with step_kinds.verify_width(self, nodes), step_kinds.ragged_verify(self, lens):
                result = super().forward_batch_generation(batch, on_publish, pp_proxy_tensors)
        # a verify's cell also carries its tree layout (only a verify pays for it)
        seconds = time.perf_counter() - decided
        if width and decision.reason == "probe":
            self.cost.probes.outcome(bs, _accepted(result, bs), decision.probe_predicted)
        if self._decision_log is not None:
            self._log_decision(batch, drafts, decision, contexts, seconds, result)
        if width in self._warm_widths:
            self.cost.observe_step(bs, width, seconds, rows, contexts, lens)
            if self.step_costs is not None:
                self.step_costs.observed(self.cost)
        else:  # a width's first step in this process pays one-off set-up: not its cost
            self._warm_widths.add(width)
            if width:
                self.cost.probes.verified(bs)
        self.stats.count_step(decode_kind(width))
        self._record_health(drafts, width)
        return result

    def _record_health(self, drafts, width: int) -> None:
        """Feed the step to :class:`SpecHealth` (every 256 steps it also judges, so a cause
        is logged when it arises, not only when stats are read)."""
        predicted = () if drafts is None else [sum(d.probs) for d in drafts]
        self.health.record(predicted, width != PLAIN)
        self._decode_steps += 1
        if self._decode_steps % 256 == 0:
            self.health.report(self.cost.calibration_at_bound())

    def _log_decision(self, batch, drafts, decision, contexts, seconds, result) -> None:
        """Append the step's decision (width, reason, expected accepted drafts, estimated
        seconds of it and of a plain step, before this step's measurement) and its outcome
        (seconds, accepted drafts) to ``$RHYME_DECISION_LOG``."""
        bs, width, counts = len(batch.reqs), decision.width, decision.counts
        accepted = _accepted(result, bs) if width else 0
        gains = [self._gains([d.probs[i] for i in best_first_order(d)], r)
                 for d, r in zip(drafts, batch.reqs)] if drafts is not None else [[] for _ in range(bs)]
        if counts is None:
            counts = [width if g else 0 for g in gains] if width else [0] * bs
        gain, estimate = self.cost.predict(bs, gains, counts, contexts)
        _, plain = self.cost.predict(bs, gains, [0] * bs, contexts)
        line = {"pid": os.getpid(), "bs": bs, "width": width, "rows": bs + int(sum(counts)),
                "reason": decision.reason,
                "keys": int(sum(contexts)), "expected": round(gain, 4),
                "estimate_s": estimate, "plain_estimate_s": plain,
                "seconds": round(seconds, 6), "accepted": accepted}
        try:
            with open(self._decision_log, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as exc:
            logger.warning("rhyme: cannot write the decision log %s: %s", self._decision_log, exc)
            self._decision_log = None

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
        """Whether this step is plain without drafting (:class:`DraftRest`); a request the
        store does not track yet, or a probe wanted at this batch size, ends the rest."""
        with self.lock:
            new = any(req.rid not in self._tracked for req in batch.reqs)
        bs = len(batch.reqs)
        return self.rest.resting(new or (self._last_decision.promising and self.cost.probes.due(bs)))

    def _choose_width(self, batch, drafts, contexts=None):
        """``(width, counts)``: the step's width (0 = plain) and, for a ragged verify, each
        request's number of draft nodes (None: every request up to ``width``). The largest
        width when widths may not vary (:meth:`_widths_vary`)."""
        if not self._widths_vary(batch):
            return Decision(self.max_width, reason="fixed")
        if self.config.cycle_widths:
            self._cycle_step += 1
            width = self._cycle[self._cycle_step % len(self._cycle)]
            if not (self.ragged and width and self._cycle_step % 2):
                return Decision(width, reason="cycle")
            # every other step: request i verifies (i + step) % (width + 1) nodes (0 included)
            return Decision(width, [(i + self._cycle_step) % (width + 1) for i in range(len(drafts))],
                            reason="cycle")
        horizon = self._horizon(batch) if self.config.horizon else None
        if self.ragged:
            raw = [[d.probs[i] for i in best_first_order(d)] for d in drafts]
            gains = [self._gains(p, r) for p, r in zip(raw, batch.reqs)]
            return self.cost.decide(len(batch.reqs), gains=gains, horizon=horizon,
                                    contexts=contexts, raw=raw)
        per_request = [expected_accepts(d, self.widths) for d in drafts]
        factors = [self._evidence_factor(r) for r in batch.reqs]
        critical = None if horizon is None else \
            self.cost.critical_expected(per_request, horizon, factors)
        expected = self.cost.batch_expected(per_request, factors)
        raw = {w: sum(r.get(w, 0.0) for r in per_request) for w in self.widths}
        return self.cost.decide(len(batch.reqs), expected=expected, calibrated=True,
                                horizon=horizon, critical=critical, contexts=contexts, raw=raw)

    def _horizon(self, batch) -> Horizon:
        """The batch's predicted remainders and the waiting queue's predicted tokens (noted
        after the last scheduling pass), for the cost model."""
        with self.lock:
            return Horizon(tuple(self._remaining(req) for req in batch.reqs), self._queued)

    def note_waiting(self, queue) -> None:
        """Keep the waiting queue's predicted tokens (after each scheduling pass)."""
        if not (self.config.horizon and self.config.adaptive):
            return
        with self.lock:
            self._queued = sum(self._remaining(req) for req in queue)

    def _remaining(self, req) -> float:
        """A request's predicted tokens to go (:func:`remaining_tokens` of its prompt's
        predicted length and its output so far); the caller holds the lock."""
        return remaining_tokens(self.store.predict_length(self._prompt_key_of(req)),
                                len(req.output_ids))

    def _gains(self, probs, req) -> list:
        """Calibrated expected acceptance of each of ``req``'s draft nodes from their path
        probabilities ``probs`` (best-first order): the shared calibration's, times the
        request's own evidence (:meth:`_evidence_factor`)."""
        return self.cost.node_gains(probs, self._evidence_factor(req))

    def _evidence_factor(self, req) -> float:
        """What ``req``'s own recent verifies accepted over what the calibration expected
        (:class:`RequestEvidence`; 1 with ``request_calibration`` off or no evidence yet)."""
        if not self.config.request_calibration:
            return 1.0
        tracked = self._tracked.get(req.rid)
        return 1.0 if tracked is None else tracked.evidence.factor()

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
                    self._tracked[req.rid].last = extra[-1]
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
                tracked = self._tracked[req.rid]
                last = tracked.last
                if last is None:
                    out_ids = req.output_ids
                    last = out_ids[-1] if len(out_ids) else req.origin_input_ids_unpadded[-1]
                tracked.last = None
                whole = float(sum(draft.probs))  # the prediction its per-request gains were scaled at
                draft = truncate(draft, width if counts is None else min(counts[i], width))
                tokens[i], masks[i], real = draft_to_tree(last, draft.token_ids, draft.parents, n)
                tracked.proposed = real
                tracked.predicted = float(sum(draft.probs[:real]))
                tracked.level = whole if self.ragged else tracked.predicted
                if self.config.request_calibration:  # what its evidence is measured against
                    tracked.expected = self.cost.expected_at(tracked.predicted, tracked.level)
                lens[i] = real + 1
        if not (self.ragged if ragged is None else ragged):
            return tokens.reshape(-1), masks.reshape(-1), None
        n = max(lens)  # padding comes last: drop the nodes no request reaches
        return tokens[:, :n].reshape(-1), masks[:, :n, :n].reshape(-1), lens

    def _update_ngram_corpus(self, batch):
        """Accepted tokens reach the store at the next draft (or at finish), not here."""

    def _sync(self, req, out_ids, extra=()) -> None:
        """Start tracking ``req`` if new, then feed the store its new output tokens: those of
        ``out_ids + extra`` past what was already synced (only that tail is copied)."""
        tracked = self._tracked.get(req.rid)
        if tracked is None:
            self.store.start_request(
                req.rid, list(req.origin_input_ids_unpadded),
                prompt_id=_custom(req, "rhyme_prompt_id"), sample=_custom(req, "rhyme_sample"),
            )
            tracked = self._tracked[req.rid] = _Tracked()
        done, base = tracked.synced, len(out_ids)
        new = (list(out_ids[done:]) + list(extra)) if done <= base else list(extra[done - base :])
        if not new:
            return
        self.store.add_tokens(req.rid, new)
        if tracked.proposed is not None:
            accepted = min(len(new) - 1, tracked.proposed)
            self.store.record_acceptance(req.rid, tracked.proposed, accepted)
            self.stats.record(self.store.epoch, tracked.proposed, len(new))
            self.cost.observe_acceptance(tracked.predicted, accepted, tracked.level)
            if self.config.request_calibration:
                tracked.evidence.observe(tracked.expected, accepted, len(new))
            tracked.proposed = None
        elif self.config.request_calibration:
            tracked.evidence.advance(len(new))
        tracked.synced = base + len(extra)

    # --------------------------------------------------------- request lifecycle
    def on_finished(self, reqs) -> None:
        """Finished requests among ``reqs`` join the history, once each: called before sglang
        streams their output and after it processed their batch."""
        with self.lock:
            for req in reqs:
                if req.finished() and not getattr(req, "_rhyme_finished", False):
                    self._finish(req)

    def _finish(self, req) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req._rhyme_finished = True

        # a verify step may accept tokens past a stop or max_new_tokens: sglang keeps them in
        # output_ids and returns only those through the stop; so does the history
        self._sync(req, req.output_ids_through_stop)
        aborted = isinstance(req.finished_reason, FINISH_ABORT)
        self.store.finish_request(req.rid, add_to_history=not aborted)
        self._tracked.pop(req.rid, None)

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

    # ----------------------------------------------------------------- ordering
    def order_waiting_queue(self, queue) -> None:
        """Longest predicted first, keeping each prompt group together (stable). Runs on every
        scheduling pass: each request's prompt key is computed once (cached on the request);
        the store memoises its predictions until the length statistics change."""
        if self.config.schedule_policy != "lpt" or len(queue) < 2:
            return
        keys = [self._prompt_key_of(req) for req in queue]
        with self.lock:
            predicted = {key: self.store.predict_length(key) for key in set(keys)}
        queue[:] = [queue[i] for i in lpt_group_order(keys, predicted)]

    def hold_back_siblings(self, queue, running_reqs, chunked_req=None, tree_cache=None) -> list:
        """Before a prefill pass: take out of ``queue`` (in place) and return the requests that
        should wait one pass because a sibling's prompt is not in the prefix cache yet (see
        :func:`rhyme_sglang.core.group_leaders`). The caller puts them back after the pass.

        With the scheduler's ``tree_cache``, a group whose prompt the cache already holds goes
        whole (stop 40: ``bench_serving`` reran cached prompts, and holding their siblings
        back only added a prefill pass), and nothing is held where the cache shares no
        prefix (``--disable-radix-cache``)."""
        if not self.config.group_prefill or len(queue) < 2:
            return []
        if tree_cache is not None and not tree_cache.supports_prefix_sharing():
            return []
        keys = [self._prompt_key_of(req) for req in queue]
        running = {self._prompt_key_of(req) for req in running_reqs}
        prefilling = () if chunked_req is None else (self._prompt_key_of(chunked_req),)
        is_cached = None if tree_cache is None else (lambda i: _prompt_cached(tree_cache, queue[i]))
        take = group_leaders(keys, running, [len(req.origin_input_ids) for req in queue],
                             prefilling, is_cached=is_cached)
        if all(take):
            return []
        held = [req for req, ok in zip(queue, take) if not ok]
        queue[:] = [req for req, ok in zip(queue, take) if ok]
        self.stats.held_back += len(held)
        return held

    @staticmethod
    def _prompt_key_of(req) -> str:
        key = getattr(req, "_rhyme_prompt_key", None)
        if key is None:
            key = prompt_key(req.origin_input_ids_unpadded, _custom(req, "rhyme_prompt_id"))
            req._rhyme_prompt_key = key
        return key
