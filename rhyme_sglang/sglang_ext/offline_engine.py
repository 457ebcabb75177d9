"""The offline ``Engine`` class: SGLang's ``Engine`` with rhyme-sglang's pieces applied.

Import it through :mod:`rhyme_sglang.sglang_ext.engine` (or ``rhyme_sglang.Engine``), which
prepares the process first: this module imports sglang, which must find the CPU environment
and the CPU backend's finders in place.

On a CPU-only machine it fills in the CPU settings (device, intel_amx attention, memory,
threads) and makes sure the CPU backend reaches the scheduler process through sglang's
``run_scheduler_process_func`` seam; the scheduler and detokenizer are forked from a process
with sglang imported (:mod:`rhyme_sglang.sglang_ext.forkserver`). Model aliases
``smollm2``/``tiny`` resolve to prepared folders. ``dtype`` absent or ``"auto"`` is decided by
measurement (:func:`rhyme_sglang.dtypes.resolve_dtype`); ``cpu_threads=N`` sets the
scheduler's compute threads.
"""

from __future__ import annotations

import dataclasses
import logging

from sglang.srt.entrypoints.engine import Engine as _SGLangEngine

from rhyme_sglang.dtypes import resolve_dtype
from rhyme_sglang.models import resolve_model_path
from rhyme_sglang.sglang_ext import forkserver, own_children
from rhyme_sglang.sglang_ext.config import RhymeConfig, check_widths_fit, new_control_addr
from rhyme_sglang.sglang_ext.control import ControlClient
from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults
from rhyme_sglang.sglang_ext.plugin import ALGORITHM
from rhyme_sglang.sglang_ext.process import run_scheduler_process

logger = logging.getLogger(__name__)


class Engine(_SGLangEngine):
    """An SGLang ``Engine`` with CPU defaults and rhyme-sglang's scheduler-process hook."""

    run_scheduler_process_func = staticmethod(run_scheduler_process)

    def __init__(self, **kwargs):
        if "model_path" not in kwargs:
            raise ValueError("Engine needs model_path (a folder, or the alias 'smollm2'/'tiny')")
        kwargs["model_path"] = resolve_model_path(kwargs["model_path"])
        kwargs["dtype"] = resolve_dtype(kwargs.get("dtype", "auto"))
        self.rhyme_config = RhymeConfig.pop_from_kwargs(kwargs)
        algo = kwargs.get("speculative_algorithm")
        self._is_rhyme = isinstance(algo, str) and algo.upper() == ALGORITHM
        if self._is_rhyme:
            kwargs["speculative_algorithm"] = ALGORITHM
            check_widths_fit(self.rhyme_config, kwargs.get("speculative_num_draft_tokens"))
        # every engine gets a control channel: RHYME's worker serves all commands, other
        # modes serve the time breakdown only (rhyme_sglang.sglang_ext.timeline)
        self.rhyme_config = dataclasses.replace(self.rhyme_config, control_addr=new_control_addr())
        self.rhyme_config.to_env()  # read by the spawned scheduler process
        self._rhyme = ControlClient(self.rhyme_config.control_addr)
        kwargs = apply_cpu_defaults(kwargs)
        forkserver.install()
        before, launched = own_children.children(), forkserver.mark()
        super().__init__(**kwargs)
        # what this engine started: its direct children (spawn) or its fork-server children
        self._own_children = (own_children.children() - before) | forkserver.started(launched)

    # ------------------------------------------------------------------ RHYME API
    def _rhyme_call(self, cmd: str, **args):
        if not self._is_rhyme:
            raise ValueError("this engine was not started with speculative_algorithm='RHYME'")
        return self._rhyme.call(cmd, **args)

    def rhyme_breakdown(self, reset: bool = False) -> dict:
        """Where the scheduler's time went since the last reset (any mode; see
        :mod:`rhyme_sglang.sglang_ext.timeline`); ``reset`` starts a new window."""
        return self._rhyme.call("breakdown", reset=bool(reset))

    def ngram_seed(self, pairs) -> dict:
        """NGRAM engines: insert earlier ``(prompt_ids, response_ids)`` pairs into the n-gram
        trie, as if this engine had generated them (:mod:`rhyme_sglang.sglang_ext.ngram_seed`)
        -> ``{"sequences", "windows", "tokens"}``."""
        from rhyme_sglang.sglang_ext.ngram_seed import as_payload

        return self._rhyme.call("ngram_seed", sequences=as_payload(pairs))

    def rhyme_set_rewards(self, rewards: list) -> dict:
        """Rewards for finished requests: ``[{"rid", "reward"}]`` or ``[{"prompt_id", "sample", "reward"}]``."""
        return self._rhyme_call("set_rewards", rewards=rewards)

    def rhyme_advance_epoch(self) -> int:
        return self._rhyme_call("advance_epoch")["epoch"]

    def rhyme_stats(self) -> dict:
        return self._rhyme_call("stats")

    def rhyme_save(self, path: str) -> dict:
        return self._rhyme_call("save", path=str(path))

    def rhyme_load(self, path: str) -> dict:
        return self._rhyme_call("load", path=str(path))

    def rhyme_reset(self) -> dict:
        return self._rhyme_call("reset")

    def rhyme_export_history(self, prompt_id: str) -> dict:
        """One prompt's history as JSON-safe data, for ``rhyme_import_history`` elsewhere."""
        return self._rhyme_call("export_history", prompt_id=prompt_id)

    def rhyme_export_histories(self, prompt_ids: list) -> list:
        """The histories of many prompts in one call (``rhyme_export_history`` each); prompts
        this engine holds no history for are omitted."""
        return self._rhyme_call("export_histories", prompt_ids=prompt_ids)

    def rhyme_drop_history(self, prompt_ids: list) -> dict:
        """Remove these prompts' whole history -> ``{"dropped", "busy", "num_prompts",
        "memory_bytes"}``: unknown ids are ignored, prompts with a request in flight are kept
        and listed in ``busy``."""
        return self._rhyme_call("drop_history", prompt_ids=prompt_ids)

    def rhyme_import_history(self, history: dict, replace: bool = False) -> dict:
        """Add an exported prompt history (held responses are skipped, or replaced when
        ``replace``) -> ``{"added", "num_responses"}``."""
        return self._rhyme_call("import_history", history=history, replace=replace)

    def rhyme_predict_lengths(self, prompts: list) -> list:
        return self._rhyme_call("predict_lengths", prompts=prompts)["lengths"]

    def rhyme_schedule_policy(self, policy: str | None = None) -> str:
        """The waiting-queue policy (``lpt`` | ``fcfs``); switches it when ``policy`` is given."""
        args = {} if policy is None else {"policy": policy}
        return self._rhyme_call("schedule_policy", **args)["policy"]

    def rhyme_draft(self, prompt: list, context: list = (), max_tokens: int = 8,
                    prompt_id: str | None = None) -> dict:
        """Inspect the draft the history store would propose after ``prompt + context``."""
        return self._rhyme_call("draft", prompt=list(prompt), context=list(context),
                                max_tokens=max_tokens, prompt_id=prompt_id)

    def shutdown(self):
        """Stop this engine's processes. Only the first call acts: sglang also calls it at
        interpreter exit, when the scheduler is long gone (a step-cost flush would wait out its
        timeout) and the PIDs it started may belong to other processes by then."""
        if getattr(self, "_shut_down", False):
            return None
        self._shut_down = True
        if getattr(self, "_rhyme", None) is not None:
            if self._is_rhyme:  # keep the measured step costs for the next engine
                flush = ControlClient(self.rhyme_config.control_addr, timeout_s=5.0)
                try:
                    flush.call("flush_step_costs")
                except Exception as exc:  # a dead scheduler: its periodic saves stand
                    logger.debug("rhyme: step costs not flushed at shutdown: %s", exc)
                finally:
                    flush.close()
            self._rhyme.close()
        with own_children.sparing(getattr(self, "_own_children", set())):
            result = super().shutdown()
        if getattr(self, "loop", None) is not None:  # absent when __init__ failed early
            self._cancel_background_tasks()
        return result

    def _cancel_background_tasks(self) -> None:
        """Stop this engine's tokenizer-manager tasks on the (process-wide) event loop.

        sglang leaves them scheduled after ``shutdown``; the next engine of the process
        would wake them, and a stale task that hits an exception calls ``sys.exit(1)``.
        """
        import asyncio

        loop = self.loop
        if loop.is_closed() or loop.is_running():
            return
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    # sglang 0.5.23 reports a weight update as failed when its cache flush races with a
    # request that has just finished (the scheduler frees it one loop later). The weights are
    # loaded by then, so finish the flush here instead of failing the caller.
    _NOT_FLUSHED = "Weights were updated, but the cache was not flushed"

    def _finish_flush(self, result):
        ok, message = result[0], result[1]
        if not ok and message.startswith(self._NOT_FLUSHED) and self.flush_cache_blocking():
            return (True, "Succeeded to update model weights (cache flushed after retry).",
                    *result[2:])
        return result

    def update_weights_from_disk(self, model_path: str, load_format=None):
        return self._finish_flush(super().update_weights_from_disk(model_path, load_format))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self._finish_flush(
            super().update_weights_from_tensor(named_tensors, load_format, flush_cache))

    async def async_pause_generation(self, mode: str = "in_place"):
        """Pause the scheduler (``in_place`` keeps requests and KV; ``abort`` returns them)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if mode not in ("in_place", "abort", "retract"):
            raise ValueError(f"pause mode must be 'in_place', 'abort' or 'retract', got {mode!r}")
        return await self.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=mode))

    async def async_continue_generation(self):
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        return await self.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    def pause_generation(self, mode: str = "in_place"):
        return self.loop.run_until_complete(self.async_pause_generation(mode))

    def continue_generation(self):
        return self.loop.run_until_complete(self.async_continue_generation())

    def flush_cache_blocking(self, timeout_s: float = 30.0) -> bool:
        """Retry ``flush_cache`` until sglang accepts it (it refuses while requests run)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            result = self.flush_cache()
            if getattr(result, "success", False) or time.monotonic() > deadline:
                return bool(getattr(result, "success", False))
            time.sleep(0.05)


__all__ = ["Engine", "sglang"]
