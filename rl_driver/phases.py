"""The phases of one step, one call each from :func:`rl_driver.loop.run`: plan -> generate ->
score -> feed history -> train -> sync weights, and with ``rollout.history: per_step`` the
history transfers between the driver's store and the engines (import, export, drop)."""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from rl_driver.balance import assign_groups
from rl_driver.config import RunConfig
from rl_driver.dispatch import DispatchConfig, Dispatcher, Job, RolloutResult, RunAhead
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
    run_ahead: Optional[Dict[str, Any]] = None  # Dispatcher.run_ahead_stats, when it ran


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


def plan_epoch(config: RunConfig, pool, prompts, affinity: Dict[str, int], store=None) -> Plan:
    """Whole prompt groups to engines by predicted load (LPT with history affinity, or
    round-robin, per ``rollout.balance``). Lengths are predicted by the engines, or with a
    driver ``store`` (:class:`rl_driver.history_store.HistoryStore`) from its records."""
    default = config.rollout.default_predicted_length
    if store is None:
        predicted = predict_lengths(pool, prompts, affinity, default)
    else:
        predicted = {p.prompt_id: store.predicted_length(p.prompt_id) or default for p in prompts}
    ids = [p.prompt_id for p in prompts]
    load = {pid: predicted[pid] * config.rollout.group_size for pid in ids}
    loads = [load[i] for i in ids]
    return Plan(ids, predicted, load,
                assign_groups(ids, loads, pool.num_engines, config.rollout.balance, affinity),
                assign_groups(ids, loads, pool.num_engines, "round_robin"))


def generate(config: RunConfig, pool, task: Task, plan: Plan, tag: str,
             restart: Callable[[int], None], after_submit: Optional[Callable[[], None]] = None,
             progress: Optional[ProgressSink] = None, seed_epoch: int = 0,
             run_ahead: Optional[RunAhead] = None) -> Rollout:
    """G samples per prompt on the planned engines (overrunning requests migrate to idle
    engines; a dead engine is restarted by ``restart(i)`` and its unfinished requests
    re-issued; ``seed_epoch``: ``dispatch.job_params``' epoch; ``run_ahead``: draft-only
    requests for the next step on idle engines)."""
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
                            on_progress=progress.rollout if progress else None,
                            seed_epoch=seed_epoch)
    pool.call_all("rhyme_breakdown", reset=True)
    restarts, restored = len(pool.restarted), pool.restored_bytes
    result = dispatcher.run(jobs, run_ahead)
    breakdown = pool.call_all("rhyme_breakdown", reset=True)
    order = {pid: k for k, pid in enumerate(plan.ids)}
    done = sorted(result.jobs, key=lambda j: (order[j.prompt_id], j.sample))
    return Rollout(result, done, breakdown, dispatcher.generation, pool.restarted[restarts:],
                   pool.restored_bytes - restored,
                   dispatcher.run_ahead_stats if run_ahead is not None else None)


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


def start_train(config: RunConfig, trainer, jobs: List[Job], rewards: Dict[str, float]):
    """Start one GRPO step on the step's responses (group-normalised advantages); returns the
    ref :func:`train` waits on."""
    advantages = group_advantages([rewards[j.key] for j in jobs], config.rollout.group_size,
                                  eps=config.train.adv_eps)
    samples = [{"prompt_ids": j.prompt_ids, "response_ids": j.response_ids,
                "logprobs": j.logprobs, "advantage": float(a)} for j, a in zip(jobs, advantages)]
    return trainer.train_step.remote(samples)


def train(config: RunConfig, trainer, jobs: List[Job], rewards: Dict[str, float],
          progress: Optional[ProgressSink] = None, ref=None) -> Dict[str, Any]:
    """One GRPO step on the step's responses (or the result of ``ref``, a started one)."""
    if ref is None:
        ref = start_train(config, trainer, jobs, rewards)
    return wait_train(trainer, ref, progress)


def sync_weights(sync, version: int, progress: Optional[ProgressSink] = None) -> float:
    """Trainer -> engines (the engines' history epoch advances with the new weights); returns
    seconds taken."""
    if progress:
        progress.sync(None)
    seconds = sync.sync(version)
    if progress:
        progress.sync(seconds)
    return seconds


def merge_histories(states: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One history per prompt from exports of several engines: records joined by (epoch,
    sample, run_ahead), the first export's record kept where two engines hold the same."""
    out: Dict[str, Dict[str, Any]] = {}
    for state in states:
        held = out.get(state["prompt_id"])
        if held is None:
            out[state["prompt_id"]] = dict(state, records=list(state["records"]))
            continue
        keys = {(r.get("epoch"), r.get("sample"), bool(r.get("run_ahead")))
                for r in held["records"]}
        held["records"] += [r for r in state["records"]
                            if (r.get("epoch"), r.get("sample"), bool(r.get("run_ahead"))) not in keys]
    return list(out.values())


def export_histories(pool, store, where: Dict[str, List[int]]) -> Dict[str, Any]:
    """Export each prompt's history from the engines ``where[prompt]`` lists (its home engine
    first), merge them and put them in the driver ``store``; returns ``seconds`` (export and
    write), ``bytes`` (as pickled), ``prompts`` and ``store_bytes`` (the shards rewritten)."""
    import ray

    t0 = time.time()
    per_engine: Dict[int, List[str]] = {}
    for pid, engines in where.items():
        for e in engines:
            per_engine.setdefault(e, []).append(pid)
    refs = {e: pool.actors[e].rhyme_export_histories.remote(ids) for e, ids in per_engine.items()}
    exported: List[Dict[str, Any]] = []
    rank = {}
    for e, ref in refs.items():
        try:
            for state in ray.get(ref):
                rank[id(state)] = where[state["prompt_id"]].index(e)
                exported.append(state)
        except Exception as exc:  # a dead engine: its restart reloads the last snapshot
            logger.warning("engine%d could not export histories: %s", e, exc)
    exported.sort(key=lambda st: rank[id(st)])  # home engines' records first
    states = merge_histories(exported)
    size = sum(len(pickle.dumps(st, protocol=5)) for st in states)
    return {"seconds": time.time() - t0, "bytes": size, "prompts": len(states),
            "store_bytes": store.put(states)}


class Transfers(NamedTuple):
    """Ray calls in flight: the next step's imports and the drops, per engine."""

    imports: Dict[int, Any]
    drops: Dict[int, Any]
    bytes: int
    issued_s: float

    def wait(self) -> Dict[str, Any]:
        """Wait for every call; ``seconds``: the slowest engine's import time, ``waited_s``:
        how long this wait took, ``num_prompts``: per engine after its drop, ``busy``: prompts
        an engine kept because a request of theirs was in flight."""
        import ray

        t0 = time.time()
        seconds, num_prompts, busy = 0.0, {}, 0
        for e, ref in self.imports.items():
            try:
                seconds = max(seconds, float(ray.get(ref)["seconds"]))
            except Exception as exc:
                logger.warning("engine%d could not import histories: %s", e, exc)
        for e, ref in self.drops.items():
            try:
                dropped = ray.get(ref)
                num_prompts[e] = dropped.get("num_prompts")
                busy += len(dropped.get("busy") or [])
            except Exception as exc:
                logger.warning("engine%d could not drop histories: %s", e, exc)
        return {"seconds": seconds, "bytes": self.bytes, "waited_s": time.time() - t0,
                "num_prompts": num_prompts, "busy": busy}


def start_transfers(pool, store, assignment: List[List[str]], drop: List[str]) -> Transfers:
    """Import the stored histories of ``assignment[e]`` into engine ``e`` (``replace``) and
    drop ``drop`` from every engine, without waiting."""
    imports, size = {}, 0
    for e, ids in enumerate(assignment):
        states = store.get(ids)
        if states:
            size += sum(len(pickle.dumps(st, protocol=5)) for st in states)
            imports[e] = pool.actors[e].rhyme_import_histories.remote(states, replace=True)
    drops = {e: pool.actors[e].rhyme_drop_history.remote(list(drop))
             for e in range(pool.num_engines)} if drop else {}
    return Transfers(imports, drops, size, time.time())
