"""The phases of one epoch, one call each from :func:`rl_driver.loop.run`: plan -> generate ->
score -> feed history -> train -> sync weights."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from rl_driver.balance import assign_groups
from rl_driver.config import RunConfig
from rl_driver.dispatch import DispatchConfig, Dispatcher, Job, RolloutResult
from rl_driver.grpo import group_advantages
from rl_driver.progress import ProgressSink, wait_train

logger = logging.getLogger(__name__)


class Task(NamedTuple):
    """The run's prompts and how their responses are scored."""

    tokenizer: Any
    prompts: list  # rl_driver.tasks.Prompt, in task order
    by_id: Dict[str, Any]
    reward_fn: Callable


class Plan(NamedTuple):
    """Which engine serves each prompt group this epoch, and the load it was predicted."""

    ids: List[str]  # prompt ids in task order
    predicted: Dict[str, float]  # predicted response length per prompt
    load: Dict[str, float]  # predicted tokens per prompt group
    assignment: List[List[str]]  # prompt ids per engine
    round_robin: List[List[str]]  # the round-robin assignment, for comparison


class Rollout(NamedTuple):
    """One epoch's finished responses, in task order, and how they were made."""

    result: RolloutResult
    jobs: List[Job]  # sorted by (prompt in task order, sample)
    breakdown: List[Dict[str, Any]]  # per engine, Engine.rhyme_breakdown over the rollout
    generation: List[int]  # per engine, its actor generation when the rollout ended
    restarted: List[int]  # engines restarted during the rollout, in order
    restored_bytes: int  # history snapshots sent to the restarted engines


class Fed(NamedTuple):
    rewards_sent: int
    responses_forwarded: int
    forwarded_bytes: int  # the forwarded histories' size, driver -> engines


def load_task(config: RunConfig, model_path: str) -> Task:
    from transformers import AutoTokenizer

    from rl_driver.rewards import load_reward_fn
    from rl_driver.tasks import build_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_prompts(config.task, tokenizer, config.seed)
    return Task(tokenizer, prompts, {p.prompt_id: p for p in prompts},
                load_reward_fn(config.task.reward_fn))


def predict_lengths(pool, prompts, affinity: Dict[str, int], default: float) -> Dict[str, float]:
    """Each prompt's predicted response length from the engine that holds its history."""
    import ray

    asked: Dict[int, List[str]] = {}
    for p in prompts:
        if p.prompt_id in affinity and affinity[p.prompt_id] < pool.num_engines:
            asked.setdefault(affinity[p.prompt_id], []).append(p.prompt_id)
    out = {p.prompt_id: default for p in prompts}
    refs = {e: pool.actors[e].rhyme_predict_lengths.remote(ids) for e, ids in asked.items()}
    for e, ref in refs.items():
        try:
            lengths = ray.get(ref)
        except Exception as exc:  # a dead engine predicts nothing; the default stands in
            logger.warning("engine%d could not predict lengths: %s", e, exc)
            continue
        for pid, n in zip(asked[e], lengths or []):
            if n and n > 0:
                out[pid] = float(n)
    return out


def plan_epoch(config: RunConfig, pool, prompts, affinity: Dict[str, int]) -> Plan:
    """Whole prompt groups to engines by predicted load (LPT with history affinity, or
    round-robin, per ``rollout.balance``)."""
    predicted = predict_lengths(pool, prompts, affinity, config.rollout.default_predicted_length)
    ids = [p.prompt_id for p in prompts]
    load = {pid: predicted[pid] * config.rollout.group_size for pid in ids}
    loads = [load[i] for i in ids]
    return Plan(ids, predicted, load,
                assign_groups(ids, loads, pool.num_engines, config.rollout.balance, affinity),
                assign_groups(ids, loads, pool.num_engines, "round_robin"))


def generate(config: RunConfig, pool, task: Task, plan: Plan, tag: str,
             restart: Callable[[int], None], after_submit: Optional[Callable[[], None]] = None,
             progress: Optional[ProgressSink] = None) -> Rollout:
    """G samples per prompt on the planned engines (overrunning requests migrate to idle
    engines; a dead engine is restarted by ``restart(i)`` and its unfinished requests
    re-issued)."""
    rollout = config.rollout
    dispatch_config = DispatchConfig(
        sampling_params=rollout.sampling_params(), migrate=rollout.migrate,
        overrun_factor=rollout.overrun_factor, poll_interval_s=rollout.poll_interval_s,
        max_restarts=config.loop.max_actor_restarts)
    jobs = [[Job(prompt_id=pid, sample=s, prompt_ids=list(task.by_id[pid].token_ids),
                 predicted=plan.predicted[pid], max_new_tokens=rollout.max_new_tokens)
             for pid in engine for s in range(rollout.group_size)] for engine in plan.assignment]
    dispatcher = Dispatcher(pool, dispatch_config, tag=tag, restart=restart,
                            after_submit=after_submit,
                            on_progress=progress.rollout if progress else None)
    pool.call_all("rhyme_breakdown", reset=True)
    restarts, restored = len(pool.restarted), pool.restored_bytes
    result = dispatcher.run(jobs)
    breakdown = pool.call_all("rhyme_breakdown", reset=True)
    order = {pid: k for k, pid in enumerate(plan.ids)}
    done = sorted(result.jobs, key=lambda j: (order[j.prompt_id], j.sample))
    return Rollout(result, done, breakdown, dispatcher.generation, pool.restarted[restarts:],
                   pool.restored_bytes - restored)


def score(task: Task, jobs: List[Job]) -> Dict[str, float]:
    """``task.reward_fn(prompt, text, token ids)`` of every response, by job key."""
    decode = task.tokenizer.decode
    return {j.key: float(task.reward_fn(task.by_id[j.prompt_id],
                                        decode(j.response_ids, skip_special_tokens=True),
                                        j.response_ids)) for j in jobs}


def send_rewards(pool, jobs: List[Job], rewards: Dict[str, float], generation: List[int]) -> int:
    """Rewards to the RHYME history of the engine that finished each response (responses
    finished by an engine that has since been restarted are not in its history)."""
    import ray

    per_engine: Dict[int, List[Dict[str, Any]]] = {}
    for job in jobs:
        if job.final_generation == generation[job.engine]:
            per_engine.setdefault(job.engine, []).append(
                {"prompt_id": job.prompt_id, "sample": job.sample, "reward": rewards[job.key]})
    updated = 0
    for e, items in per_engine.items():
        try:
            updated += int(ray.get(pool.actors[e].rhyme_set_rewards.remote(items)).get("updated", 0))
        except Exception as exc:
            logger.warning("engine%d refused rewards: %s", e, exc)
    return updated


def feed_history(pool, rollout: Rollout, rewards: Dict[str, float]) -> Fed:
    """Rewards to the engines' history, and each prompt's home engine the full responses that
    migration or a restart kept out of its history."""
    from rl_driver.pool import forward_full_responses

    forwarded = forward_full_responses(pool.actors, rollout.jobs, rewards, rollout.generation)
    return Fed(send_rewards(pool, rollout.jobs, rewards, rollout.generation), forwarded.added,
               forwarded.bytes)


def train(config: RunConfig, trainer, jobs: List[Job], rewards: Dict[str, float],
          progress: Optional[ProgressSink] = None) -> Dict[str, Any]:
    """One GRPO step on the epoch's responses (group-normalised advantages)."""
    advantages = group_advantages([rewards[j.key] for j in jobs], config.rollout.group_size,
                                  eps=config.train.adv_eps)
    samples = [{"prompt_ids": j.prompt_ids, "response_ids": j.response_ids,
                "logprobs": j.logprobs, "advantage": float(a)} for j, a in zip(jobs, advantages)]
    return wait_train(trainer, trainer.train_step.remote(samples), progress)


def sync_weights(sync, version: int, progress: Optional[ProgressSink] = None) -> float:
    """Trainer -> engines (the engines' history epoch advances with the new weights); returns
    seconds taken."""
    if progress:
        progress.sync(None)
    seconds = sync.sync(version)
    if progress:
        progress.sync(seconds)
    return seconds
