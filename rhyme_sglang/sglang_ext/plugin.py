"""sglang plugin (entry point ``sglang.srt.plugins: rhyme``): registers RHYME in every process.

sglang calls :func:`register` at start-up in the main, scheduler and detokenizer processes.
It registers the ``RHYME`` speculative algorithm through ``SpeculativeAlgorithm.register``
and three named hooks through sglang's ``HookRegistry``:

* ``stream_hook`` before ``SchedulerOutputStreamer.stream_output``: finished responses join
  the history before their output leaves the scheduler, so a client that has its response
  finds it in the history (stats, rewards by ``(prompt_id, sample)``). ``finish_hook`` after
  ``Scheduler.process_batch_result`` catches any finished request not streamed;
* ``weights_hook`` after sglang records a successful weight load (disk, tensor,
  distributed or IPC): the history epoch advances before the next draft;
* ``ordering_hook`` after ``SchedulePolicy.calc_priority``: longest-predicted-first queue;
* ``prefill_hook`` around ``Scheduler.get_new_batch_prefill``: siblings of a prompt not yet
  in the prefix cache wait one pass (``group_prefill``); after the pass the worker notes the
  waiting queue's predicted tokens (the cost model's ``horizon``);
* ``idle_hook`` after ``Scheduler.on_idle``: the worker's ``check_integrity`` (once per idle
  period).

Each of these is a no-op unless a RhymeWorker runs in the process. ``spec_logprobs_hook``
around ``compute_spec_logprobs`` trims unused accept slots on CPU (NGRAM and RHYME). Two more, around
``Scheduler.run_batch`` and ``Scheduler.process_batch_result``, keep the time breakdown of
:mod:`.timeline` in every mode. One after ``NGRAMWorker.__init__`` lets an NGRAM engine's trie be
seeded with earlier responses (:mod:`.ngram_seed`).
"""

from __future__ import annotations

import logging

from rhyme_sglang.sglang_ext import ALGORITHM  # noqa: F401  (engine.py imports it from here)

logger = logging.getLogger(__name__)
DEFAULT_MAX_RUNNING = 48  # running requests per engine unless --max-running-requests is given
_registered = False


def _worker():
    from rhyme_sglang.sglang_ext.worker import ACTIVE_WORKERS

    return ACTIVE_WORKERS[0] if ACTIVE_WORKERS else None


def finish_hook(result, scheduler, batch, *args, **kwargs):
    worker = _worker() if batch is not None else None
    if worker is not None:
        worker.on_finished(batch.reqs)
    return result


def stream_hook(streamer, reqs, *args, **kwargs):
    from rhyme_sglang.sglang_ext import timeline

    timeline.record_step()  # before a client can see the step's outputs
    worker = _worker()
    if worker is not None and reqs:
        worker.on_finished(reqs)


def weights_hook(result, *args, **kwargs):
    worker = _worker()
    if worker is not None:
        worker.note_weights_updated()
    return result


def ordering_hook(result, policy, waiting_queue, *args, **kwargs):
    worker = _worker()
    if worker is not None:
        worker.scheduling.order(waiting_queue)
    return result


def idle_hook(result, *args, **kwargs):
    worker = _worker()
    if worker is not None:
        worker.check_integrity()
    return result


def prefill_hook(original, *args, **kwargs):
    worker = _worker()
    if worker is None:
        return original(*args, **kwargs)
    scheduler = args[0]
    running = args[1] if len(args) > 1 else kwargs.get("running_batch")
    held = worker.scheduling.hold_back_siblings(scheduler.waiting_queue,
                                                running.reqs if running is not None else [],
                                                getattr(scheduler, "chunked_req", None),
                                                getattr(scheduler, "tree_cache", None))
    try:
        return original(*args, **kwargs)
    finally:
        if held:
            scheduler.waiting_queue[:0] = held
        worker.scheduling.note_waiting(scheduler.waiting_queue)


def spec_logprobs_hook(original, batch, logits_output, predict, *, accept_index=None,
                       chain_stride=None):
    """Around ``compute_spec_logprobs``: only the ``accept_index`` columns some request uses.

    sglang gathers one logits row per column of ``accept_index`` (``[bs, draft tokens]``,
    unused slots ``-1``) and takes a full-vocabulary ``log_softmax`` of each, so a RHYME
    plain step (one column used of 17) would do 17x the work it needs. Columns are filled
    from the left, so dropping those no request uses changes no logprob (rows are
    independent) and the scheduler reads as many per request as it accepted. CPU only: on a GPU the ``.max()`` would cost a device sync.
    """
    if accept_index is not None and accept_index.device.type == "cpu" and accept_index.shape[1] > 1:
        used = max(1, int((accept_index >= 0).sum(dim=1).max()))
        accept_index = accept_index[:, :used]
    return original(batch, logits_output, predict, accept_index=accept_index,
                    chain_stride=chain_stride)


def _spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ngram = SpeculativeAlgorithm.NGRAM

    class RhymeSpecAlgo(CustomSpecAlgo):
        """Behaves as NGRAM everywhere sglang asks (tree verify, no draft model, no draft
        KV), except that its worker drafts from the history store."""

        def handle_server_args(self, server_args) -> None:
            if getattr(server_args, "device", None) == "cpu":
                server_args.disable_overlap_schedule = True
            if server_args.max_running_requests is None:
                server_args.max_running_requests = DEFAULT_MAX_RUNNING
            server_args.enable_mixed_chunk = False
            if server_args.speculative_num_draft_tokens is None:  # widths 1, 2, 4, 8, 16
                server_args.speculative_num_draft_tokens = 17
            server_args.speculative_eagle_topk = server_args.speculative_ngram_max_bfs_breadth
            if server_args.speculative_num_steps is None:
                server_args.speculative_num_steps = (
                    server_args.speculative_num_draft_tokens // server_args.speculative_eagle_topk
                )
            # sglang's own n-gram corpus is built but unused: keep it tiny
            server_args.speculative_ngram_capacity = 1024

    for name in ("is_ngram", "supports_target_verify_for_draft", "supports_prefill_shared_read_done",
                 "supports_mixed_chunk", "supports_ragged_verify", "supports_grammar_overlap",
                 "has_draft_kv", "get_num_tokens_per_req_for_target_verify",
                 "resolve_max_speculative_num_draft_tokens", "build_disagg_draft_input",
                 "carries_draft_hidden_states", "need_topk", "create_future_map"):
        if hasattr(ngram, name):
            setattr(RhymeSpecAlgo, name,
                    lambda self, *a, _n=name, **k: getattr(ngram, _n)(*a, **k))
    return RhymeSpecAlgo


def _worker_factory(server_args):
    from rhyme_sglang.sglang_ext.worker import RhymeWorker

    return RhymeWorker


def register() -> None:
    """Entry point called by sglang's ``load_plugins`` (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from rhyme_sglang.sglang_ext import check_sglang_version

    check_sglang_version()
    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_spec_class())(
        _worker_factory
    )
    HookRegistry.register("sglang.srt.managers.scheduler_components.output_streamer."
                          "SchedulerOutputStreamer.stream_output", stream_hook, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.process_batch_result",
                          finish_hook, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.weight_updater."
        "SchedulerWeightUpdaterManager.record_weight_version_after_update",
        weights_hook, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
                          ordering_hook, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
                          prefill_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", idle_hook,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.layers.logprob_processor.compute_spec_logprobs",
                          spec_logprobs_hook, HookType.AROUND)
    from rhyme_sglang.sglang_ext import timeline

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch",
                          timeline.run_batch_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.process_batch_result",
                          timeline.result_hook, HookType.AROUND)
    from rhyme_sglang.sglang_ext import ngram_seed

    HookRegistry.register("sglang.srt.speculative.ngram_worker.NGRAMWorker.__init__",
                          ngram_seed.capture_hook, HookType.AFTER)
    _registered = True
