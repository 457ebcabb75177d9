"""``RolloutActor``: a Ray actor owning one rhyme-sglang engine, with the RL framework method set.

Methods follow the names OpenRLHF/verl/slime rollout workers already call: ``generate``,
``init_process_group``, ``update_weight``, ``update_weights_from_tensor`` (and
``update_weights_from_bucket`` for the tensor sync),
``update_weights_from_disk``, ``reset_prefix_cache``, ``sleep``/``wake_up``,
``pause_generation``/``resume_generation``, ``get_num_unfinished_requests``; plus the driver's
per-request ``generate_one`` (streamed, so ``progress`` can report tokens in flight, and
``abort`` returns the partial output for lossless migration) and the RHYME history calls
(``rhyme_set_rewards``, ``rhyme_advance_epoch``, ``rhyme_stats``, ``rhyme_save``,
``rhyme_load``, ``rhyme_snapshot`` / ``rhyme_restore`` (a snapshot's bytes, carried by Ray:
no disk shared between nodes), ``rhyme_reset``, ``rhyme_predict_lengths``, ``rhyme_export_history`` /
``rhyme_export_histories`` / ``rhyme_import_history`` / ``rhyme_import_histories`` /
``rhyme_drop_history``). When RHYME is off the history
calls are answered locally (empty stats, no predictions) and never reach the engine.

All methods are ``async`` (a Ray async actor), so many ``generate_one`` calls run at once
and the engine batches them; blocking engine calls run in worker threads. Create it with
:func:`make_rollout_actor`. ``sleep``/``wake_up`` map to sglang's release/resume memory
occupation on GPU and are documented no-ops on CPU (the CPU backend has no memory saver).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Dict, List, Optional

from rl_driver.engine_host import EngineHost

logger = logging.getLogger(__name__)


def _ok(result) -> tuple:
    """sglang answers weight calls with a tuple ``(success, message, ...)`` or an object."""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))


def finish_type(meta: Dict[str, Any]) -> str:
    reason = meta.get("finish_reason")
    return reason.get("type", "stop") if isinstance(reason, dict) else str(reason or "stop")


class RolloutActor:
    """One engine per actor process (sglang keeps server args in process-global state)."""

    def __init__(self, engine_kwargs: Dict[str, Any], rhyme: bool = False, name: str = "engine"):
        import ray

        from rhyme_sglang.settings import prepare_cpu_env

        # a GPU engine's devices come from Ray (CUDA_VISIBLE_DEVICES)
        prepare_cpu_env(cpu_engine=not ray.get_gpu_ids())
        logging.basicConfig(level=logging.INFO)
        self.name = name
        self.rhyme = rhyme
        self.engine_kwargs = dict(engine_kwargs)
        self.host = EngineHost(self.engine_kwargs)
        self.engine = self.host.engine
        self.weight_version = 0
        self._progress: Dict[str, int] = {}
        self._sleeping = False
        self._group_name = "rhyme_sync"

    async def _blocking(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    # ---- generation -------------------------------------------------------------------------
    async def ready(self) -> Dict[str, Any]:
        return {"name": self.name, "rhyme": self.rhyme, "weight_version": self.weight_version}

    async def node(self) -> Dict[str, Any]:
        """Where this engine runs: node id, IP, pid, GPU ids and ``CUDA_VISIBLE_DEVICES``."""
        from rl_driver.placement import node_info

        return node_info()

    async def path_exists(self, path: str) -> bool:
        """Whether ``path`` exists on this engine's node (the shared-folder check)."""
        import os

        return os.path.exists(path)

    async def _stream(self, rid: str, input_ids: List[int], params: Dict[str, Any]):
        gen = await self.engine.async_generate(input_ids=input_ids, sampling_params=params,
                                               rid=rid, stream=True, return_logprob=True)
        last = None
        async for chunk in gen:
            last = chunk
            self._progress[rid] = len(chunk["output_ids"])
        return last

    async def generate_one(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """Generate one response. ``request``: rid, input_ids, sampling_params, and optionally
        prompt_id/sample (sent to RHYME as ``custom_params``) and ``run_ahead`` (true: a
        draft-only request, ``rhyme_run_ahead``, whose tokens the engine keeps as drafts of the
        prompt's next visit). Returns output ids, logprobs,
        the finish type ('stop' | 'length' | 'abort'), spec stats and actor-side timestamps."""
        rid = request["rid"]
        params = dict(request["sampling_params"])
        if self.rhyme and "prompt_id" in request:
            params["custom_params"] = {"rhyme_prompt_id": str(request["prompt_id"]),
                                       "rhyme_sample": int(request.get("sample", 0))}
            if request.get("run_ahead"):
                params["custom_params"]["rhyme_run_ahead"] = True
        start = time.time()
        self._progress[rid] = 0
        try:
            out = await asyncio.wrap_future(
                self.host.submit(self._stream(rid, list(request["input_ids"]), params)))
        finally:
            self._progress.pop(rid, None)
        meta = out["meta_info"]
        logprobs = [float(lp[0]) for lp in meta.get("output_token_logprobs") or []]
        return {
            "rid": rid, "engine": self.name, "output_ids": list(out["output_ids"]),
            "logprobs": logprobs, "finish_reason": finish_type(meta),
            "spec_verify_ct": int(meta.get("spec_verify_ct") or 0),
            "completion_tokens": int(meta.get("completion_tokens") or len(out["output_ids"])),
            "start_s": start, "end_s": time.time(), "weight_version": self.weight_version,
        }

    async def generate(self, input_ids: List[List[int]], sampling_params: Any,
                       rids: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        """Batch generation (the OpenRLHF/verl-style call): one dict per prompt."""
        rids = rids or [f"{self.name}-{time.monotonic_ns()}-{i}" for i in range(len(input_ids))]
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params] * len(input_ids)
        return list(await asyncio.gather(*[
            self.generate_one({"rid": r, "input_ids": ids, "sampling_params": p})
            for r, ids, p in zip(rids, input_ids, params)]))

    async def progress(self) -> Dict[str, int]:
        """Tokens generated so far by each request in flight."""
        return dict(self._progress)

    async def abort(self, rids: List[str]) -> int:
        """Abort requests; their ``generate_one`` returns the partial output ('abort')."""
        n = 0
        for rid in rids:
            if rid in self._progress:
                self.host.call_soon(self.engine.tokenizer_manager.abort_request, rid)
                n += 1
        return n

    async def get_num_unfinished_requests(self) -> int:
        return len(self._progress)

    async def pause_generation(self, mode: str = "in_place"):
        return await self._blocking(self.engine.pause_generation, mode)

    async def resume_generation(self):
        return await self._blocking(self.engine.continue_generation)

    async def reset_prefix_cache(self) -> bool:
        return await self._blocking(self.engine.flush_cache_blocking)

    async def sleep(self, level: int = 1) -> bool:
        """Release KV/weight memory (GPU); a no-op returning False on CPU."""
        if self.engine_kwargs.get("enable_memory_saver") and not _on_cpu():
            await self._blocking(self.engine.release_memory_occupation)
            self._sleeping = True
            return True
        return False

    async def wake_up(self, tags: Optional[List[str]] = None) -> bool:
        """Resume memory released by ``sleep``; ``tags`` (OpenRLHF's ``["weights"]`` /
        ``["kv_cache"]``) are accepted, and everything is resumed at once."""
        if self._sleeping:
            await self._blocking(self.engine.resume_memory_occupation)
            self._sleeping = False
            return True
        return False

    # ---- weights ---------------------------------------------------------------------------
    async def begin_weight_update(self):
        return await self._blocking(self.engine.begin_weight_update)

    async def end_weight_update(self, weight_version: Optional[int] = None):
        result = await self._blocking(self.engine.end_weight_update)
        if weight_version is not None:
            self.weight_version = int(weight_version)
        return _ok(result)

    async def update_weights_from_tensor(self, named_tensors, flush_cache: bool = False):
        """Load ``[(name, tensor)]`` (call inside begin/end_weight_update)."""
        result = await self._blocking(self.engine.update_weights_from_tensor, named_tensors,
                                      flush_cache=flush_cache)
        ok, message = _ok(result)
        if not ok:
            raise RuntimeError(f"{self.name}: update_weights_from_tensor failed: {message}")
        return ok

    async def update_weights_from_bucket(self, bucket, flush_cache: bool = False):
        """Load a :func:`rl_driver.weight_sync.to_bucket` bucket (read from Ray's object
        store without a copy; call inside begin/end_weight_update)."""
        from rl_driver.weight_sync import from_bucket

        return await self.update_weights_from_tensor(from_bucket(bucket), flush_cache)

    async def update_weights_from_disk(self, path: str, weight_version: Optional[int] = None):
        ok, message = _ok(await self._blocking(self.engine.update_weights_from_disk, path))
        if not ok:
            raise RuntimeError(f"{self.name}: update_weights_from_disk failed: {message}")
        if weight_version is not None:
            self.weight_version = int(weight_version)
        return ok

    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, group_name: str, backend: str = "gloo",
                                 use_ray: bool = False):
        """Join the trainer's weight-broadcast group (torch.distributed; ``use_ray=True``,
        OpenRLHF's ray.util.collective transport, is not supported)."""
        if use_ray:
            raise ValueError(f"{self.name}: use_ray weight sync is not supported; "
                             "use a torch.distributed backend (gloo/nccl)")
        self._group_name = group_name
        ok, message = _ok(await self._blocking(
            self.engine.init_weights_update_group, master_address, master_port, rank_offset,
            world_size, group_name, backend))
        if not ok:
            raise RuntimeError(f"{self.name}: init_weights_update_group failed: {message}")
        return ok

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str,
                                              flush_cache: bool = False):
        ok, message = _ok(await self._blocking(
            self.engine.update_weights_from_distributed, names, dtypes, shapes, group_name,
            flush_cache))
        if not ok:
            raise RuntimeError(f"{self.name}: update_weights_from_distributed failed: {message}")
        return ok

    async def update_weight(self, name: str, dtype, shape, empty_cache: bool = False,
                            group_name: Optional[str] = None):
        """OpenRLHF's per-parameter broadcast receive, on the group of the last
        ``init_process_group`` (``empty_cache``: OpenRLHF marks the last parameter; the
        prefix cache is flushed then)."""
        return await self.update_weights_from_distributed(
            [name], [str(dtype).replace("torch.", "")], [list(shape)],
            group_name or self._group_name, flush_cache=bool(empty_cache))

    async def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)

    # ---- RHYME history ---------------------------------------------------------------------
    async def rhyme_set_rewards(self, rewards: List[Dict[str, Any]]) -> Dict[str, Any]:
        if not self.rhyme:
            return {"updated": 0}
        return await self._blocking(self.engine.rhyme_set_rewards, rewards)

    async def rhyme_advance_epoch(self) -> int:
        if not self.rhyme:
            return -1
        return await self._blocking(self.engine.rhyme_advance_epoch)

    async def rhyme_stats(self) -> Dict[str, Any]:
        if not self.rhyme:
            return {}
        return dict(await self._blocking(self.engine.rhyme_stats))

    async def rhyme_breakdown(self, reset: bool = False) -> Dict[str, Any]:
        """The engine's time breakdown since the last reset (any mode)."""
        return dict(await self._blocking(self.engine.rhyme_breakdown, reset))

    async def rhyme_save(self, path: str) -> bool:
        if not self.rhyme:
            return False
        await self._blocking(self.engine.rhyme_save, path)
        return True

    async def rhyme_load(self, path: str) -> bool:
        if not self.rhyme:
            return False
        await self._blocking(self.engine.rhyme_load, path)
        return True

    async def rhyme_snapshot(self) -> Optional[bytes]:
        """The history snapshot's bytes (``rhyme_save`` to a file of this node, read back and
        removed), for the driver to keep; None when RHYME is off."""
        if not self.rhyme:
            return None
        import os
        import tempfile

        fd, path = tempfile.mkstemp(suffix=".rhyme")
        os.close(fd)
        try:
            await self._blocking(self.engine.rhyme_save, path)
            with open(path, "rb") as fh:
                return fh.read()
        finally:
            os.unlink(path)

    async def rhyme_restore(self, data: bytes) -> bool:
        """Load a :meth:`rhyme_snapshot` (written to a file of this node, loaded, removed)."""
        if not self.rhyme:
            return False
        import os
        import tempfile

        fd, path = tempfile.mkstemp(suffix=".rhyme")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            await self._blocking(self.engine.rhyme_load, path)
        finally:
            os.unlink(path)
        return True

    async def rhyme_reset(self) -> bool:
        if self.rhyme:
            await self._blocking(self.engine.rhyme_reset)
        return self.rhyme

    async def rhyme_export_history(self, prompt_id: str) -> Optional[Dict[str, Any]]:
        """The prompt's history for another engine's ``rhyme_import_history``; None when RHYME
        is off or this engine holds nothing for the prompt."""
        if not self.rhyme:
            return None
        try:
            return await self._blocking(self.engine.rhyme_export_history, prompt_id)
        except ValueError:
            return None

    async def rhyme_export_histories(self, prompt_ids: List[str]) -> List[Dict[str, Any]]:
        """The histories of ``prompt_ids`` (``Engine.rhyme_export_histories``: prompts this
        engine lacks are left out); [] when RHYME is off."""
        if not self.rhyme:
            return []
        return list(await self._blocking(self.engine.rhyme_export_histories, list(prompt_ids)))

    async def rhyme_drop_history(self, prompt_ids: List[str]) -> Dict[str, Any]:
        """Forget ``prompt_ids`` (``Engine.rhyme_drop_history``: ``dropped``, ``busy`` (prompts
        with requests in flight, kept), ``num_prompts``, ``memory_bytes``)."""
        if not self.rhyme:
            return {"dropped": 0, "busy": [], "num_prompts": 0, "memory_bytes": 0}
        return dict(await self._blocking(self.engine.rhyme_drop_history, list(prompt_ids)))

    async def rhyme_import_history(self, history: Dict[str, Any], replace: bool = False) -> int:
        """Add an exported history (or ``transfer.response_state``); returns responses added."""
        if not self.rhyme:
            return 0
        return int((await self._blocking(self.engine.rhyme_import_history, history,
                                         replace))["added"])

    async def rhyme_import_histories(self, histories: List[Dict[str, Any]],
                                     replace: bool = False) -> Dict[str, Any]:
        """Add several exported histories -> ``{"added", "seconds"}`` (this engine's time)."""
        start = time.time()
        added = 0
        for history in histories:
            added += await self.rhyme_import_history(history, replace)
        return {"added": added, "seconds": time.time() - start}

    async def rhyme_predict_lengths(self, prompts: List[List[int]]) -> Optional[List[float]]:
        """Predicted response lengths, or None when RHYME is off (the caller's default)."""
        if not self.rhyme:
            return None
        return [float(x) for x in await self._blocking(self.engine.rhyme_predict_lengths, prompts)]

    async def shutdown(self) -> None:
        self.host.shutdown()


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def make_rollout_actor(engine_kwargs: Dict[str, Any], rhyme: bool = False, name: str = "engine",
                       num_cpus: float = 1, max_concurrency: int = 1000, actor_class=None,
                       options: Optional[Dict[str, Any]] = None):
    """Start a ``RolloutActor`` (or ``actor_class``, a subclass) under Ray (call
    ``ray.get(actor.ready.remote())`` to wait). ``options``: Ray actor options (resources,
    scheduling strategy: :class:`rl_driver.placement.Placement`), in place of ``num_cpus``."""
    import ray

    cls = ray.remote(actor_class or RolloutActor)
    options = {"num_cpus": num_cpus} if options is None else options
    return cls.options(max_concurrency=max_concurrency, name=None,
                       **options).remote(engine_kwargs, rhyme=rhyme, name=name)
