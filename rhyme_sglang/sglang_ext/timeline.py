"""The scheduler's time breakdown, in every mode (vanilla, NGRAM, RHYME), from two hooks.

``run_batch_hook`` (around ``Scheduler.run_batch``) times each forward and classifies it:
prefill (extend/mixed batches: tokens computed and prefix-cache hits) or a decode step of a
kind (``plain`` or ``verify_w<width>``; the RHYME worker reports the width it chose, NGRAM
always verifies ``speculative_num_draft_tokens - 1``). ``result_hook`` (around
``Scheduler.process_batch_result``) times result processing and counts the tokens the step
emitted. Gaps between steps count as scheduling while requests are in flight and as idle
otherwise. The breakdown is read (and its window restarted) with the ``breakdown`` control
command; for engines without RHYME the scheduler process serves it itself (:func:`maybe_serve`),
with NGRAM's ``ngram_seed`` (:mod:`.ngram_seed`).
"""

from __future__ import annotations

import logging
import time

from rhyme_sglang.core.breakdown import TimeBreakdown

logger = logging.getLogger(__name__)
BREAKDOWN = TimeBreakdown()
_STEP = {"width": None, "rows": None, "fixed_width": None}


def note_width(width: int, rows=None) -> None:
    """The RHYME worker's verify width for the step being run (0 = plain decode) and, for a
    per-request verify, the tree nodes its forward runs (None: every request at ``width``)."""
    _STEP["width"] = width
    _STEP["rows"] = rows


def _fixed_width(scheduler) -> int:
    if _STEP["fixed_width"] is None:
        algo = getattr(scheduler, "spec_algorithm", None)
        n = getattr(getattr(scheduler, "server_args", None), "speculative_num_draft_tokens", None)
        speculative = algo is not None and not getattr(algo, "is_none", lambda: True)()
        _STEP["fixed_width"] = (n - 1) if speculative and n else 0
    return _STEP["fixed_width"]


def _emitted(batch) -> int:
    return sum(len(req.output_ids) for req in batch.reqs)


def _prefix_tokens(batch) -> int:
    """Tokens of an extend batch's requests already in the KV cache before it runs (prefix-
    cache hits; for a chunked prefill also the earlier chunks). sglang 0.5.23 keeps the
    length as ``req.prefix_len``; earlier versions kept the ``prefix_indices`` tensor."""
    total = 0
    for req in batch.reqs:
        n = getattr(req, "prefix_len", None)
        total += int(n) if n is not None else len(getattr(req, "prefix_indices", ()) or ())
    return total


def run_batch_hook(original, *args, **kwargs):
    scheduler, batch = args[0], args[1] if len(args) > 1 else kwargs.get("batch")
    mode = batch.forward_mode
    _STEP["width"] = _STEP["rows"] = None
    cached = _prefix_tokens(batch) if mode.is_extend() or mode.is_mixed() else 0
    start = time.perf_counter()
    BREAKDOWN.on_step_start(start)
    result = original(*args, **kwargs)
    seconds = time.perf_counter() - start
    if mode.is_extend() or mode.is_mixed():
        tokens = batch.extend_num_tokens or 0
        BREAKDOWN.on_prefill(start, seconds, len(batch.reqs), int(tokens), int(cached))
        _STEP["decode"] = None
    elif mode.is_decode():
        width = _STEP["width"] if _STEP["width"] is not None else _fixed_width(scheduler)
        _STEP["decode"] = (start, width, seconds, len(batch.reqs), _STEP["rows"])
    else:
        _STEP["decode"] = None
    return result


def record_step() -> None:
    """Record the decode step whose result is being processed, once: called before its
    outputs are streamed (``plugin.stream_hook``), so a client that has its output and then
    resets the breakdown never finds that step in the new window, and after the result's
    processing for a step that streamed nothing."""
    pending = _STEP.pop("result", None)  # set only while a result is being processed
    if pending is None:
        return
    step = _STEP.pop("decode", None)
    if step is not None:
        batch, before = pending
        BREAKDOWN.on_decode(step[0], step[1], step[2], step[3], _emitted(batch) - before,
                            rows=step[4])


def result_hook(original, *args, **kwargs):
    scheduler, batch = args[0], args[1] if len(args) > 1 else kwargs.get("batch")
    if batch is not None:
        _STEP["result"] = (batch, _emitted(batch))
    start = time.perf_counter()
    result = original(*args, **kwargs)
    end = time.perf_counter()
    if batch is None:
        return result
    record_step()
    busy = any(not req.finished() for req in batch.reqs) or bool(
        getattr(scheduler, "waiting_queue", None))
    BREAKDOWN.on_step_end(end - start, busy, end)
    return result


def breakdown(reset: bool = False) -> dict:
    """The breakdown since the last reset; ``reset`` starts a new window after reading."""
    if not isinstance(reset, bool):
        raise ValueError(f"reset must be a boolean, got {reset!r}")
    out = BREAKDOWN.as_dict()
    if reset:
        BREAKDOWN.reset()
    return out


class _PeerCommands:
    """Control-command handler for engines without a RHYME worker: ``breakdown``, and
    ``ngram_seed`` on NGRAM engines (:mod:`.ngram_seed`)."""

    def command(self, name: str, args: dict):
        if name == "breakdown":
            return breakdown(**args)
        if name == "ngram_seed":
            from rhyme_sglang.sglang_ext import ngram_seed

            return ngram_seed.seed(**args)
        raise ValueError(f"this engine was not started with RHYME; only 'breakdown' and "
                         f"'ngram_seed' (NGRAM) are served, got {name!r}")


def maybe_serve(server_args) -> None:
    """In a scheduler process without RHYME, serve ``breakdown`` (and ``ngram_seed``) on the
    control address."""
    from rhyme_sglang.sglang_ext import ALGORITHM
    from rhyme_sglang.sglang_ext.config import RhymeConfig

    algo = str(getattr(server_args, "speculative_algorithm", "") or "").upper()
    addr = RhymeConfig.from_env().control_addr
    if algo != ALGORITHM and addr:
        from rhyme_sglang.sglang_ext.control import ControlServer

        ControlServer(addr, _PeerCommands()).start()
