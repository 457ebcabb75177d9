"""Scheduler policy over sglang's waiting queue: order, group prefill, and the horizon.

* :meth:`Scheduling.order` (after ``SchedulePolicy.calc_priority``): longest predicted first,
  each prompt group kept together (``schedule_policy="lpt"``).
* :meth:`Scheduling.hold_back_siblings` (before a prefill pass): siblings of a prompt not yet
  in the prefix cache wait one pass (``group_prefill``; :func:`rhyme_sglang.core.group_leaders`).
* :meth:`Scheduling.note_waiting` (after a prefill pass) and :meth:`Scheduling.horizon`: the
  predicted tokens left, for the cost model's :class:`Horizon`.
"""

from __future__ import annotations

from rhyme_sglang.core import group_leaders, lpt_group_order, prompt_key
from rhyme_sglang.core.horizon import Horizon, remaining_tokens
from rhyme_sglang.core.ordering import MIN_SHARED
from rhyme_sglang.sglang_ext.validation import custom_param, is_run_ahead


def prompt_key_of(req) -> str:
    """``req``'s prompt key (its ``rhyme_prompt_id``, else a hash of its prompt), cached on it."""
    key = getattr(req, "_rhyme_prompt_key", None)
    if key is None:
        key = prompt_key(req.origin_input_ids_unpadded, custom_param(req, "rhyme_prompt_id"))
        req._rhyme_prompt_key = key
    return key


def _prompt_radix_key(tree_cache, req, prompt):
    """The prefix cache's key of ``prompt`` less its last token: sglang's private
    ``_req_radix_key``, the one reach into sglang internals of this module."""
    from sglang.srt.mem_cache.common import _req_radix_key

    return _req_radix_key(tree_cache, req, prompt, max(len(prompt) - 1, 0))


def _prompt_cached(tree_cache, req) -> bool:
    """Whether the prefix cache holds ``req``'s prompt but for fewer than ``MIN_SHARED``
    tokens. Asked once per request (kept on it): a prompt cached when its group arrived
    stays worth sharing from, and a group that starts prefilling is running from then on."""
    cached = getattr(req, "_rhyme_prompt_cached", None)
    if cached is None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        prompt = req.origin_input_ids
        key = _prompt_radix_key(tree_cache, req, prompt)
        hit = tree_cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
        cached = req._rhyme_prompt_cached = len(prompt) - hit < MIN_SHARED
    return cached


class Scheduling:
    """The worker's scheduling policy over its draft ``store`` (length predictions) and
    ``config`` (``schedule_policy``, ``group_prefill``, ``horizon``, ``adaptive``); counts held
    requests in ``stats``. Methods that read the store take ``lock``. The worker replaces
    ``store``, ``stats`` and ``config`` when a control command replaces its own."""

    def __init__(self, store, stats, config, lock):
        self.store, self.stats, self.config, self.lock = store, stats, config, lock
        self.queued = 0.0  # the waiting queue's predicted tokens at the last scheduling pass

    def order(self, queue) -> None:
        """Longest predicted first, keeping each prompt group together (stable), in place.
        Runs on every scheduling pass: each request's prompt key is computed once (cached on
        the request); the store memoises its predictions until the length statistics change."""
        if self.config.schedule_policy != "lpt" or len(queue) < 2:
            return
        keys = [prompt_key_of(req) for req in queue]
        with self.lock:
            predicted = {key: self.store.predict_length(key) for key in set(keys)}
        queue[:] = [queue[i] for i in lpt_group_order(keys, predicted)]

    def hold_back_siblings(self, queue, running_reqs, chunked_req=None, tree_cache=None) -> list:
        """Before a prefill pass: take out of ``queue`` (in place) and return the requests that
        should wait one pass because a sibling's prompt is not in the prefix cache yet. The
        caller puts them back after the pass. With the scheduler's ``tree_cache``, a group
        whose prompt the cache already holds goes whole, and nothing is held where the cache
        shares no prefix (``--disable-radix-cache``)."""
        if not self.config.group_prefill or len(queue) < 2:
            return []
        if tree_cache is not None and not tree_cache.supports_prefix_sharing():
            return []
        keys = [prompt_key_of(req) for req in queue]
        running = {prompt_key_of(req) for req in running_reqs}
        prefilling = () if chunked_req is None else (prompt_key_of(chunked_req),)
        is_cached = None if tree_cache is None else (lambda i: _prompt_cached(tree_cache, queue[i]))
        take = group_leaders(keys, running, [len(req.origin_input_ids) for req in queue],
                             prefilling, is_cached=is_cached)
        if all(take):
            return []
        held = [req for req, ok in zip(queue, take) if not ok]
        queue[:] = [req for req, ok in zip(queue, take) if ok]
        self.stats.held_back += len(held)
        return held

    def note_waiting(self, queue) -> None:
        """Keep the waiting queue's predicted tokens (after each scheduling pass)."""
        if not (self.config.horizon and self.config.adaptive):
            return
        with self.lock:
            self.queued = sum(self._remaining(req) for req in queue)

    def horizon(self, reqs) -> Horizon:
        """The running ``reqs``' predicted remainders, the waiting queue's predicted tokens
        (noted after the last scheduling pass) and the run-ahead requests (background), for
        the cost model."""
        background = frozenset(i for i, req in enumerate(reqs) if is_run_ahead(req))
        with self.lock:
            return Horizon(tuple(self._remaining(req) for req in reqs), self.queued, background)

    def _remaining(self, req) -> float:
        """A request's predicted tokens to go (:func:`remaining_tokens`); the caller holds
        the lock."""
        return remaining_tokens(self.store.predict_length(prompt_key_of(req)),
                                len(req.output_ids))
