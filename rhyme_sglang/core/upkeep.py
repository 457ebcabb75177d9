"""Keeping the tries consistent with the response records: add, re-weight, rebase, evict."""

from __future__ import annotations

import logging
import math
import time
from array import array
from typing import Optional

from . import weights as W
from .branching import observe_epoch
from .history import PromptHistory, ResponseRecord

logger = logging.getLogger(__name__)
RECORD_BYTES = 160


class HistoryUpkeep:
    """Mixin of DraftStore holding every operation that changes trie weights or membership.

    Invariant: each alive record is in its prompt's trie with `weight`, and in the global trie
    iff `in_global`; records of the open epoch wait in `_pending_global` unless
    `global_same_epoch`. Group reward factors are recomputed only for closed epochs.
    Run-ahead (draft-only) records weigh `run_ahead_weight` times a real response of their
    epoch, keep the neutral factor (no reward), stay out of `_finished` (no reward by request
    id) and out of the length statistics.

    The residue: a dropped prompt's records leave its trie and every per-prompt count but keep
    their global-trie contributions (alive, in the global trie or waiting for the epoch close),
    up to `dropped_global_tokens` tokens, the earliest dropped prompt out first, and out when
    the prompt comes back (a request or an import), so an import counts nothing twice.
    """

    def _too_old(self, epoch: int) -> bool:
        keep = self.config.history_epochs
        return keep is not None and epoch < self.epoch - keep

    def _weight(self, rec: ResponseRecord, factor: float) -> int:
        """The trie weight of `rec` with reward factor `factor` (scaled when draft-only)."""
        if rec.run_ahead:
            factor = self.config.run_ahead_weight  # no reward: the neutral factor, scaled
        return W.response_weight(factor, rec.epoch, self.epoch_origin, self.config.epoch_decay)

    def _mark_dirty(self, key: str, epoch: int) -> None:
        (self._dirty_closed if epoch < self.epoch else self._dirty_open).add((key, epoch))

    def _change(self, trie, change, *args) -> None:
        """Apply `change` (a bound trie method) to `trie`, keeping `_trie_bytes` current."""
        before = trie.estimate_memory()
        change(*args)
        self._trie_bytes += trie.estimate_memory() - before

    def _store(self, rec: ResponseRecord) -> None:
        """Insert the record into its prompt's trie (and the global one when `in_global`)."""
        tree = self._prompts[rec.key].tree
        self._change(tree, tree.insert, rec.seq, rec.weight)
        if rec.in_global:
            self._change(self._global, self._global.insert, rec.seq, rec.weight)

    def _unstore(self, rec: ResponseRecord) -> None:
        tree = self._prompts[rec.key].tree
        self._change(tree, tree.remove, rec.seq, rec.weight)
        if rec.in_global:
            self._change(self._global, self._global.remove, rec.seq, rec.weight)

    def _reweight(self, rec: ResponseRecord, weight: int) -> None:
        dweight = weight - rec.weight
        self._prompts[rec.key].tree.reweight(rec.seq, dweight)
        if rec.in_global:
            self._global.reweight(rec.seq, dweight)
        rec.weight = weight

    def _to_global(self, rec: ResponseRecord) -> None:
        if self.config.use_global and not rec.in_global and rec.alive:
            rec.in_global = True
            self._change(self._global, self._global.insert, rec.seq, rec.weight)

    def history_bytes(self) -> int:
        """Estimated bytes of the evictable history (prompt and global tries, records and the
        residue's records); O(1)."""
        return (self._trie_bytes + 4 * (self._num_tokens + self._residue_tokens)
                + RECORD_BYTES * (self._num_records + self._residue_records))

    def _recount_trie_bytes(self) -> None:
        self._trie_bytes = self._global.estimate_memory() + sum(
            ph.tree.estimate_memory() for ph in self._prompts.values())

    def _add_record(self, ph: PromptHistory, response: array, epoch: int, sample: int,
                    reward: Optional[float], request_id: Optional[str],
                    run_ahead: bool = False) -> ResponseRecord:
        seq = array("i", ph.prompt_tail)
        seq.extend(response)
        rec = ResponseRecord(ph.key, epoch, sample, seq, len(response),
                             None if run_ahead else reward, 1.0, run_ahead=run_ahead)
        rec.weight = self._weight(rec, 1.0)
        rec.request_id = request_id
        self._store(rec)
        if epoch < self.epoch or self.config.global_same_epoch:
            self._to_global(rec)
        else:
            self._pending_global.append(rec)
        ph.group(epoch).append(rec)
        self._num_records += 1
        self._num_tokens += len(seq)
        if run_ahead:
            return rec  # no reward target, no length statistics, no change to the group's rewards
        if request_id is not None:
            self._finished[request_id] = rec
        self.lengths.record(ph.key, epoch, sample, len(response))
        self._mark_dirty(ph.key, epoch)
        return rec

    @property
    def _needs_flush(self) -> bool:
        return bool(self._dirty_closed) or (self.config.sibling_rewards == "finished"
                                            and bool(self._dirty_open))

    def _flush(self) -> None:
        """Recompute reward factors of closed groups whose rewards or members changed (and of
        open groups too with `sibling_rewards="finished"`)."""
        cfg = self.config
        groups = set(self._dirty_closed)
        if cfg.sibling_rewards == "finished":
            groups |= self._dirty_open
            self._dirty_open.clear()
        for key, epoch in sorted(groups):
            ph = self._prompts.get(key)
            group = ph.records.get(epoch, []) if ph is not None else []
            adv = W.group_advantages({i: r.reward for i, r in enumerate(group)})
            for i, rec in enumerate(group):
                if rec.run_ahead:
                    continue  # draft-only: neutral factor, weight fixed by its epoch
                rec.factor = W.reward_factor(adv[i], self.reward_coef, cfg.advantage_clip)
                new = self._weight(rec, rec.factor)
                if new != rec.weight:
                    self._reweight(rec, new)
        self._dirty_closed.clear()

    def _refit_reward(self) -> None:
        """`reward_rule="online"`, at the close of the open epoch: update the reward coefficient
        from the branch choices of the epoch's responses; a new coefficient re-weights every
        closed group at the next flush."""
        cfg, t0 = self.config, time.perf_counter()
        walked = observe_epoch(self._reward_fit, list(self._prompts.values()), self.epoch,
                               cfg.epoch_decay, cfg.advantage_clip, cfg.max_pattern,
                               cfg.reward_fit_tokens)
        coef = self._reward_fit.close_epoch()
        logger.info("reward fit at epoch %d: coef %.2f (%d tokens, %.0f branch points, %.2f s)",
                    self.epoch, coef, walked, self._reward_fit.points, time.perf_counter() - t0)
        if coef != self.reward_coef:
            self.reward_coef = coef
            self._dirty_closed |= {(ph.key, e) for ph in self._prompts.values() for e in ph.records}

    def _rebase(self) -> None:
        """Move the epoch origin forward and rebuild the tries with the smaller weights."""
        span = int(math.log(W.MAX_RECENCY_FACTOR) / -math.log(self.config.epoch_decay)) // 2
        self.epoch_origin = max(self.epoch_origin, self.epoch - span)
        logger.info("rebasing draft-store weights to epoch %d", self.epoch_origin)
        self._global = self._new_trie(self.config.global_depth)
        for ph in self._prompts.values():
            ph.tree = self._new_trie()
        self._recount_trie_bytes()
        for rec in self.records():
            rec.weight = self._weight(rec, rec.factor)
            self._store(rec)
        for rec in self.residue_records():
            rec.weight = self._weight(rec, rec.factor)
            if rec.in_global:
                self._change(self._global, self._global.insert, rec.seq, rec.weight)

    def _evict_epoch(self, ph: PromptHistory, epoch: int, keep_global: bool = False) -> list:
        """Remove the epoch's records from `ph`; returns them. `keep_global`: they leave the
        prompt's trie only and stay alive (in the global trie or queued for it: the residue)."""
        group = ph.records.pop(epoch, [])
        for rec in group:
            if keep_global:
                self._change(ph.tree, ph.tree.remove, rec.seq, rec.weight)
            else:
                self._unstore(rec)
                rec.alive = False
            self._num_records -= 1
            self._num_tokens -= len(rec.seq)
            if rec.request_id is not None and self._finished.get(rec.request_id) is rec:
                del self._finished[rec.request_id]
            rec.request_id = None
        self._dirty_open.discard((ph.key, epoch))
        self._dirty_closed.discard((ph.key, epoch))
        return group

    def _import_responses(self, key: str, tail, responses, replace: bool) -> int:
        """Add checked responses (`transfer.ImportedResponse`) to prompt `key`; a held
        (epoch, sample) is skipped, or replaced when `replace`; epochs outside the kept history
        window are skipped. Returns how many were added."""
        ph = self._touch(key, tail)
        added = 0
        for r in responses:
            if self._too_old(r.epoch):
                continue
            held = ph.find(r.epoch, r.sample, r.run_ahead)
            if held is not None:
                if not replace:
                    continue
                self._remove_record(ph, held)
            rid = None if r.request_id in self._finished else r.request_id  # ids stay unique
            self._add_record(ph, r.response, r.epoch, r.sample, r.reward, rid, r.run_ahead)
            added += 1
        self._drop_if_empty(ph)
        self._enforce_budget()
        return added

    def _remove_record(self, ph: PromptHistory, rec: ResponseRecord) -> None:
        self._unstore(rec)
        if not rec.in_global:
            self._pending_global = [r for r in self._pending_global if r is not rec]
        rec.alive = False
        group = ph.records[rec.epoch]
        group.remove(rec)
        if not group:
            del ph.records[rec.epoch]
        self._num_records -= 1
        self._num_tokens -= len(rec.seq)
        if rec.request_id is not None and self._finished.get(rec.request_id) is rec:
            del self._finished[rec.request_id]
        if not rec.run_ahead:
            self._mark_dirty(ph.key, rec.epoch)

    def _drop_if_empty(self, ph: PromptHistory) -> None:
        if not ph.records and ph.num_active == 0:
            self._trie_bytes -= ph.tree.estimate_memory()
            del self._prompts[ph.key]
            self.lengths.forget(ph.key)

    def _drop_prompt(self, ph: PromptHistory) -> None:
        """Remove a prompt without requests in flight: its records leave its trie, the reward
        bookkeeping and the length statistics. Their global-trie contributions stay as the
        residue (class docstring), or go too when `dropped_global_tokens` is 0 or there is no
        global trie."""
        keep = self.config.use_global and self.config.dropped_global_tokens > 0
        if not keep:
            pending = {id(r) for group in ph.records.values() for r in group if not r.in_global}
            if pending:
                self._pending_global = [r for r in self._pending_global if id(r) not in pending]
        kept = [rec for epoch in list(ph.records) for rec in self._evict_epoch(ph, epoch, keep)]
        self._drop_if_empty(ph)
        if not keep or not kept:
            return
        self._residue[ph.key] = kept
        self._residue_records += len(kept)
        self._residue_tokens += sum(len(r.seq) for r in kept)
        while self._residue_tokens > self.config.dropped_global_tokens:
            self._evict_residue()

    def residue_records(self):
        """The residue's records (class docstring), earliest dropped prompt first."""
        for group in self._residue.values():
            yield from group

    def _evict_residue(self) -> None:
        """Remove the earliest dropped prompt's residue from the global trie (or its queue)."""
        _, group = self._residue.popitem(last=False)
        self._forget_residue(group)

    def _age_residue(self) -> None:
        """Residue records outside the kept history window (`history_epochs`) go."""
        for key in list(self._residue):
            group = self._residue[key]
            old = [r for r in group if self._too_old(r.epoch)]
            if old:
                self._forget_residue(old)
                keep = [r for r in group if not self._too_old(r.epoch)]
                if keep:
                    self._residue[key] = keep
                else:
                    del self._residue[key]

    def _forget_residue(self, group) -> None:
        for rec in group:
            if rec.in_global:
                self._change(self._global, self._global.remove, rec.seq, rec.weight)
                rec.in_global = False
            rec.alive = False
        gone = {id(r) for r in group}
        self._pending_global = [r for r in self._pending_global if id(r) not in gone]
        self._residue_records -= len(group)
        self._residue_tokens -= sum(len(r.seq) for r in group)

    def _end_residue(self, key: str) -> None:
        """Prompt `key` is back (a request or an import): its residue leaves the global trie,
        so an import of its history counts nothing twice."""
        group = self._residue.pop(key, None)
        if group:
            self._forget_residue(group)

    def _enforce_budget(self) -> None:
        budget = self.config.memory_budget
        if budget is None:
            return
        while self.history_bytes() > budget:
            if self._residue:
                self._evict_residue()
                continue
            victim = next((ph for ph in self._prompts.values() if ph.records), None)
            if victim is None:
                logger.warning("draft store over its memory budget with nothing left to evict")
                return
            self._evict_epoch(victim, min(victim.records))
            self._drop_if_empty(victim)
