"""Plugging rhyme-sglang rollouts into an existing RL framework.

The framework keeps its trainer and loop; rhyme-sglang replaces the rollout engine. Three
pieces are all any framework needs:

1. engines: ``RolloutActor`` (in-process sglang engine in a Ray actor, via
   :func:`start_engines`) or ``RolloutHTTPClient`` (an already running server);
2. :func:`rollout_groups` as the rollout function: prompt groups in, responses with
   rollout logprobs out, RHYME grouping (``prompt_id``/``sample``) passed along;
3. after scoring, :func:`report_rewards`; after the weight update, nothing: the history
   epoch advances with the new weights.

**OpenRLHF**: its vLLM engines are Ray actors with ``init_process_group``,
``update_weight(name, dtype, shape)``, ``reset_prefix_cache``, ``sleep``/``wake_up``;
``RolloutActor`` answers the same calls, so pass ``start_engines(...)`` where OpenRLHF
expects ``vllm_engines`` and call :func:`rollout_groups` from the experience maker's
generate step (``n_samples_per_prompt`` = group size).

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

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from rl_driver.dispatch import DispatchConfig, Dispatcher, Job


class _Engines:
    """The minimal pool interface the dispatcher needs, over given actors."""

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)
        self.num_engines = len(self.actors)

    def restart(self, i: int) -> None:
        raise RuntimeError(f"engine {i} died; restart it in your framework and retry")


def start_engines(model: str, num_engines: int = 1, rhyme: bool = True,
                  **engine_kwargs) -> List[Any]:
    """Start ``RolloutActor``s under Ray (``ray.init`` first); returns the actor handles."""
    import ray

    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import EngineConfig
    from rl_driver.rollout import make_rollout_actor

    kwargs = EngineConfig(num_engines=num_engines, rhyme=rhyme).server_args(resolve_model_path(model))
    kwargs.update(engine_kwargs)
    actors = [make_rollout_actor(kwargs, rhyme=rhyme, name=f"engine{i}") for i in range(num_engines)]
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
