"""Plugging rhyme-sglang rollouts into an existing RL framework.

The framework keeps its trainer and loop; rhyme-sglang replaces the rollout engine. Three
pieces are all any framework needs:

1. engines: ``RolloutActor`` (in-process sglang engine in a Ray actor, via
   :func:`start_engines`) or ``RolloutHTTPClient`` (an already running server);
2. :func:`rollout_groups` as the rollout function: prompt groups in, responses with
   rollout logprobs out, RHYME grouping (``prompt_id``/``sample``) passed along;
3. after scoring, :func:`report_rewards`; after the weight update, nothing: the history
   epoch advances with the new weights.

**OpenRLHF** (checked against ``openrlhf==0.11.2``'s own source by
``tests/driver/test_openrlhf_contract.py``): its trainer and weight sync call, on each engine
actor, ``init_process_group(addr, port, rank_offset, world_size, group_name, backend=,
use_ray=)``, ``update_weight(name, dtype=, shape=, empty_cache=)``,
``update_weight_cuda_ipc(...)``, ``reset_prefix_cache()``, ``sleep()``, ``wake_up(tags=)``,
``pause_generation()``, ``resume_generation()``, ``get_num_unfinished_requests()`` and
``generate_responses(prompt=, label=, sampling_params=, max_length=, hf_tokenizer=,
num_samples=, images=)``. Where OpenRLHF differed from us we adapted ``RolloutActor``:
``use_ray`` is accepted (``True`` is refused: only torch.distributed broadcast is
supported), ``update_weight`` takes ``empty_cache`` and uses the group of the last
``init_process_group`` (OpenRLHF names it ``"openrlhf"``; we used a fixed name), ``wake_up``
takes ``tags``. Two calls need an adapter, :class:`OpenRLHFRolloutActor` (start it with
``start_engines(..., openrlhf=True)`` and pass the handles as ``vllm_engines``):
``generate_responses`` runs the prompt's ``num_samples`` as one RHYME group (prompt id = a
hash of the text, sample = index) and returns OpenRLHF's single-turn output dicts
(``observation_tokens``, ``action_ranges``, ``rollout_log_probs``, ``truncated``; rewards are
left ``None``: OpenRLHF's agent executors and remote reward models do not run inside it, so
score with your reward path and send rewards with :func:`report_rewards`);
``update_weight_cuda_ipc`` raises (no CUDA IPC; use broadcast sync). OpenRLHF's vLLM-only
``generate(prompt_token_ids, sampling_params)`` (called by its executors inside the vLLM
actor, returning a vLLM ``RequestOutput``) is not provided: ``RolloutActor.generate`` is the
batched token-id call.

**verl**: in a custom rollout worker's ``generate_sequences(prompts)``, turn the batch's
``input_ids`` (unpadded) and ``uid`` (the group id) into groups, call
:func:`rollout_groups`, and fill ``responses`` / ``rollout_log_probs`` from the results;
sync weights with ``update_weights_from_tensor`` inside ``begin_weight_update`` /
``end_weight_update``.

**slime**: point ``--custom-generate-function-path`` (or ``--rollout-function-path``) at a
function that calls :func:`rollout_groups` with each sample group's token ids and fills
``sample.tokens``, ``sample.rollout_log_probs``, ``sample.response_length``; after the
reward model, call :func:`report_rewards`.

Example (any framework)::

    from rl_driver.hooks import start_engines, rollout_groups, report_rewards
    engines = start_engines("smollm2", num_engines=2, rhyme=True)
    out = rollout_groups(engines, {"p0": ids0, "p1": ids1}, group_size=8,
                         sampling_params={"temperature": 1.0, "max_new_tokens": 256})
    report_rewards(engines, out, {(r["prompt_id"], r["sample"]): score(r) for r in out})
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from rl_driver.dispatch import DispatchConfig, Dispatcher, Job, job_params
from rl_driver.rollout import RolloutActor


class _Engines:
    """The minimal pool interface the dispatcher needs, over given actors."""

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)
        self.num_engines = len(self.actors)

    def restart(self, i: int) -> None:
        raise RuntimeError(f"engine {i} died; restart it in your framework and retry")


def vllm_to_sglang_params(sp: Any, max_tokens: int) -> Dict[str, Any]:
    """sglang sampling params from a vLLM ``SamplingParams`` (read by attribute; unset or
    vLLM-default values are left to sglang's defaults)."""
    out: Dict[str, Any] = {"max_new_tokens": int(max_tokens)}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("min_p", "min_p"), ("stop", "stop"), ("stop_token_ids", "stop_token_ids"),
                         ("ignore_eos", "ignore_eos"), ("skip_special_tokens", "skip_special_tokens"),
                         ("min_new_tokens", "min_tokens"), ("sampling_seed", "seed")):
        value = getattr(sp, theirs, None)
        if value is not None and not (theirs == "top_k" and value in (0, -1)):
            out[ours] = value
    return out


def _prompt_group_id(prompt: str) -> str:
    import hashlib

    return "openrlhf:" + hashlib.blake2b(prompt.encode("utf-8"), digest_size=12).hexdigest()


class OpenRLHFRolloutActor(RolloutActor):
    """``RolloutActor`` plus the two OpenRLHF engine calls it lacks (see the module docstring)."""

    async def generate_responses(self, prompt: str, label: Any, sampling_params: Any,
                                 max_length: int, hf_tokenizer: Any, num_samples: int = 1,
                                 images: Any = None) -> List[Dict[str, Any]]:
        """``num_samples`` responses to one text prompt, in OpenRLHF's output dict shape."""
        import asyncio

        if images:
            raise ValueError("OpenRLHFRolloutActor: image prompts are not supported")
        ids = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        max_tokens = getattr(sampling_params, "max_tokens", None) or max(1, max_length - len(ids))
        ids = ids[-max(1, max_length - max_tokens):]
        params = vllm_to_sglang_params(sampling_params, max_tokens)
        group = _prompt_group_id(prompt)
        outs = await asyncio.gather(*[self.generate_one({
            "rid": f"{group}/{time.monotonic_ns()}/{i}", "prompt_id": group, "sample": i,
            "input_ids": ids, "sampling_params": job_params(params, group, i)})
            for i in range(num_samples)])
        want_logprobs = getattr(sampling_params, "logprobs", None) is not None
        return [{
            "prompt": prompt, "label": label, "images": None, "mm_train_inputs": None,
            "observation_tokens": list(ids) + o["output_ids"],
            "action_ranges": [(len(ids), len(ids) + len(o["output_ids"]))],
            "rollout_log_probs": [0.0] * len(ids) + o["logprobs"] if want_logprobs else None,
            "truncated": o["finish_reason"] == "length",
            "reward": None, "scores": None, "extra_logs": {},
        } for o in outs]

    async def update_weight_cuda_ipc(self, name: str, dtype: Any, shape: Any, ipc_handles: Any,
                                     empty_cache: bool = False):
        raise RuntimeError(f"{self.name}: CUDA IPC weight sync is not supported by rhyme-sglang "
                           "engines; use OpenRLHF's broadcast sync (update_weight)")


def start_engines(model: str, num_engines: int = 1, rhyme: bool = True, openrlhf: bool = False,
                  **engine_kwargs) -> List[Any]:
    """Start ``RolloutActor``s (``OpenRLHFRolloutActor`` with ``openrlhf``) under Ray
    (``ray.init`` first); returns the actor handles."""
    import ray

    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import EngineConfig
    from rl_driver.rollout import make_rollout_actor

    kwargs = EngineConfig(num_engines=num_engines, rhyme=rhyme).server_args(resolve_model_path(model))
    kwargs.update(engine_kwargs)
    cls = OpenRLHFRolloutActor if openrlhf else RolloutActor
    actors = [make_rollout_actor(kwargs, rhyme=rhyme, name=f"engine{i}", actor_class=cls)
              for i in range(num_engines)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def rollout_groups(engines: Sequence[Any], prompts: Mapping[str, Sequence[int]], group_size: int,
                   sampling_params: Dict[str, Any], predicted: Optional[Mapping[str, float]] = None,
                   migrate: bool = True) -> List[Dict[str, Any]]:
    """G samples per prompt over Ray ``RolloutActor``s, groups balanced by predicted length
    (LPT), overrunning requests migrated losslessly. Returns one dict per response:
    prompt_id, sample, response_ids, logprobs, finish_reason, engine."""
    from rl_driver.balance import assign_groups

    pool = _Engines(engines)
    ids = list(prompts)
    default = float(sampling_params.get("max_new_tokens", 128)) / 2
    pred = {pid: float((predicted or {}).get(pid, default)) for pid in ids}
    assignment = assign_groups(ids, [pred[p] * group_size for p in ids], pool.num_engines)
    jobs = [[Job(prompt_id=pid, sample=s, prompt_ids=list(prompts[pid]), predicted=pred[pid],
                 max_new_tokens=int(sampling_params.get("max_new_tokens", 128)))
             for pid in eng for s in range(group_size)] for eng in assignment]
    config = DispatchConfig(sampling_params=dict(sampling_params), migrate=migrate)
    result = Dispatcher(pool, config, tag="hook/").run(jobs)
    return [{"prompt_id": j.prompt_id, "sample": j.sample, "response_ids": j.response_ids,
             "logprobs": j.logprobs, "finish_reason": j.finish_reason, "engine": j.engine}
            for j in result.jobs]


def report_rewards(engines: Sequence[Any], results: List[Dict[str, Any]],
                   rewards: Mapping[Tuple[str, int], float]) -> int:
    """Send each response's reward to the RHYME history of the engine that produced it."""
    import ray

    per_engine: Dict[int, List[Dict[str, Any]]] = {}
    for r in results:
        per_engine.setdefault(r["engine"], []).append(
            {"prompt_id": r["prompt_id"], "sample": r["sample"],
             "reward": float(rewards[(r["prompt_id"], r["sample"])])})
    outs = ray.get([engines[e].rhyme_set_rewards.remote(items) for e, items in per_engine.items()])
    return sum(int(o.get("updated", 0)) for o in outs)
