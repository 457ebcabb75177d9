"""The RL loop, top to bottom: assign -> generate -> score -> rewards to history -> train -> sync.

``run(config)`` starts Ray (if needed), one ``Trainer`` and ``engine.num_engines``
``RolloutActor``s, then for each step (:mod:`rl_driver.steps`: ``rollout.prompts_per_step``
prompts of a per-epoch shuffle; 0 = every prompt, one step per epoch):

1. predict each prompt group's response length (``rhyme_predict_lengths`` on the engine that
   served it last; with ``rollout.history: per_step`` the driver's store; else
   ``rollout.default_predicted_length``) and assign whole groups to engines (LPT with history
   affinity, or round-robin);
2. generate G samples per prompt (overrunning requests migrate to idle engines; a dead
   engine is restarted from its snapshot and its unfinished requests re-issued; with
   ``rollout.run_ahead`` idle engines draft the next step's prompts until the last job ends);
3. score each response with ``task.reward_fn``;
4. send the rewards to the engines' RHYME history (``rhyme_set_rewards``), and give each
   prompt's home engine the full responses migration or a restart kept out of its history
   (``pool.forward_full_responses``);
5. GRPO update on the trainer; with ``per_step`` history, meanwhile: the step's histories
   exported to the store (``run_dir/history``), the next step's imported into their engines,
   the step's other prompts dropped from the engines;
6. sync weights trainer -> engines (the history epoch advances with the new weights, so a
   history's recency counts policy updates);
7. wait for the imports, snapshot histories, checkpoint the trainer, append metrics (JSONL;
   ``epochs.jsonl`` after an epoch's last step in a run of steps) and the trace.

``run(config, resume=True)`` continues from the next step of ``runs/<name>``.
Each phase is one call: :mod:`rl_driver.phases` holds them, :mod:`rl_driver.stack` the actors
(start, resume, restart, shutdown), :mod:`rl_driver.step_history` a step's history loading and
run-ahead, :mod:`rl_driver.metrics` the step's metrics and files.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional

from rl_driver import phases
from rl_driver.config import RunConfig
from rl_driver.history_store import HistoryStore
from rl_driver.metrics import (TraceLog, append_metrics, epoch_aggregate, epoch_metrics,
                               open_run_dir, read_metrics)
from rl_driver.step_history import StepHistory
from rl_driver.steps import Step, StepSampler
from rl_driver.progress import ProgressSink
from rl_driver.stack import start_stack, wait

logger = logging.getLogger(__name__)


def start_ray(config: RunConfig) -> None:
    """Join the cluster at ``cluster.address`` (or ``RAY_ADDRESS``, as ``ray job submit`` sets
    it); without either, start a local instance of ``loop.ray_num_cpus`` CPUs (0 = all)."""
    import os

    import ray

    if ray.is_initialized():
        return
    address = config.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, log_to_driver=False)
        logger.info("joined the Ray cluster at %s: %d node(s), %s", address,
                    sum(n["Alive"] for n in ray.nodes()), ray.cluster_resources())
        return
    kwargs = {"num_cpus": config.loop.ray_num_cpus} if config.loop.ray_num_cpus else {}
    ray.init(include_dashboard=False, log_to_driver=False, **kwargs)


def run(config: RunConfig, resume: bool = False,
        on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
        on_rollout_start: Optional[Callable[[int, Any], None]] = None,
        progress: Optional[ProgressSink] = None) -> List[Dict[str, Any]]:
    """Run (or resume) the loop; returns the per-step metrics of this invocation (one step
    per epoch unless ``rollout.prompts_per_step`` is set).

    ``on_epoch(metrics)`` is called after each step; ``on_rollout_start(epoch, pool)`` once
    a step's requests are all in flight (fault-injection tests use it); ``progress`` hears
    each phase's progress inside a step."""
    from rl_driver.warm_start import policy_path

    # setup: run dir, Ray, task, trainer + engines (+ the last finished step on resume)
    config = config.resolved()  # dtype / threads "auto" -> this machine's measured choice
    state = open_run_dir(config.run_dir, dataclasses.asdict(config), resume)
    start_ray(config)
    model_path = policy_path(config, log=logger.info)  # the warm start's folder when enabled
    task = phases.load_task(config, model_path)
    sampler = StepSampler([p.prompt_id for p in task.prompts], config.rollout.prompts_per_step,
                          config.seed)
    store = (HistoryStore(config.run_dir / "history", config.rollout.history_shards)
             if config.rollout.history == "per_step" else None)
    trace = TraceLog(config.run_dir / "trace.jsonl.gz", keep=resume, before_epoch=state.next_step)
    stack = start_stack(config, model_path, state, resume)
    pool, results = stack.pool, []
    history = StepHistory(config, pool, task, store)  # per-step loading and run-ahead
    total = config.loop.epochs * sampler.steps_per_epoch
    first = state.next_step
    try:
        for s in range(state.next_step, total):
            step = sampler.step(s)
            nxt = sampler.step(s + 1) if s + 1 < total else None
            # plan: whole prompt groups to engines by predicted load
            plan = history.plan(step, nxt, state.affinity, first=s == first)
            # generate G samples per prompt (a dead engine is restarted, its requests re-issued);
            # idle engines draft the next step's prompts meanwhile (run-ahead)
            rollout = phases.generate(
                config, pool, task, plan, tag=step_tag(config, sampler, step),
                restart=lambda i: stack.restart(i, state.weight_version),
                after_submit=(lambda: on_rollout_start(step.epoch, pool)) if on_rollout_start else None,
                progress=progress, seed_epoch=s, run_ahead=history.run_ahead())
            # reward, then rewards and full responses to the engines' history
            rewards = phases.score(task, rollout.jobs)
            fed = phases.feed_history(pool, rollout, rewards)
            # train; per_step: the step's histories to the store, the next step's to its
            # engines, while the trainer works
            train_ref = phases.start_train(config, stack.trainer, rollout.jobs, rewards)
            history.start_transfers(rollout)
            train = phases.train(config, stack.trainer, rollout.jobs, rewards, progress, ref=train_ref)
            history.trained(train)
            # sync weights; the trainer writes its checkpoint meanwhile (both only read weights)
            state.weight_version = int(train["version"])
            checkpoint = stack.start_checkpoint(config.loop.checkpoint)
            sync_s = phases.sync_weights(stack.sync, state.weight_version, progress)
            history.wait()  # the next step's imports and this step's drops
            # snapshot histories (a restarted engine gets the next step's imports back); the
            # checkpoint lands before the state that points past it
            pool.snapshot_all()
            wait(checkpoint)
            state.affinity.update({pid: e for e, eng in enumerate(plan.assignment) for pid in eng})
            state.next_step = s + 1
            state.next_epoch = nxt.epoch if nxt is not None else step.epoch + 1
            rhyme_stats = pool.call_all("rhyme_stats")
            metrics = epoch_metrics(
                step.epoch, balance=config.rollout.balance, plan=plan, rollout=rollout,
                rewards=rewards, fed=fed, train=train, sync_s=sync_s, sync_method=stack.sync.method,
                rhyme_stats=rhyme_stats, snapshot_bytes=pool.snapshot_bytes,
                startup_s=stack.startup_s if s == state.first_epoch_of_process else 0.0,
                engine_nodes=stack.engine_nodes())
            if sampler.shuffle:
                metrics.update(step_keys(config, sampler, step))
            metrics.update(history.metrics(rollout, rhyme_stats))
            # record: trace, metrics line, state
            record_epoch(config, trace, state, rollout, rewards, metrics, trace_epoch=s)
            if sampler.shuffle and (nxt is None or nxt.epoch != step.epoch):
                record_epoch_aggregate(config.run_dir, step.epoch)
            results.append(metrics)
            if on_epoch is not None:
                on_epoch(metrics)
        if config.loop.save_final and results:
            save_final(config, stack.trainer, task.tokenizer)
    finally:
        stack.shutdown()
    if config.loop.trace:
        trace.write_meta(model=config.model, config=dataclasses.asdict(config), metrics=results)
    return results


def step_tag(config: RunConfig, sampler: StepSampler, step: Step) -> str:
    """Request ids' prefix: ``<name>/e<epoch>/``, or ``<name>/s<step>/`` in a run of steps."""
    return f"{config.name}/s{step.step}/" if sampler.shuffle else f"{config.name}/e{step.epoch}/"


def step_keys(config: RunConfig, sampler: StepSampler, step: Step) -> Dict[str, Any]:
    """A step's place in the run and how its prompts were seen before."""
    return {"step": step.step, "step_in_epoch": step.step_in_epoch,
            "num_prompts": len(step.prompt_ids), "group_size": config.rollout.group_size,
            **sampler.visit(step.step).summary()}


def record_epoch(config: RunConfig, trace: TraceLog, state, rollout: phases.Rollout,
                 rewards: Dict[str, float], metrics: Dict[str, Any],
                 trace_epoch: Optional[int] = None) -> None:
    """The step's responses to the trace (as ``trace_epoch``, the global step: the policy
    version that made them), its metrics line, then the state that points past it
    (``metrics.RunState``)."""
    if config.loop.trace:
        trace.add_epoch(metrics["epoch"] if trace_epoch is None else trace_epoch,
                        rollout.jobs, rewards)
    append_metrics(config.run_dir / "metrics.jsonl", metrics)
    state.save(config.run_dir)
    logger.info("epoch %d%s: reward %.3f, rollout %.1fs (%.0f tok/s, tau %.2f, bubble %.2f)",
                metrics["epoch"], f" step {metrics['step']}" if "step" in metrics else "",
                metrics["mean_reward"], metrics["rollout_makespan_s"],
                metrics["tokens_per_s"], metrics["tau"], metrics["bubble_ratio"])


def record_epoch_aggregate(run_dir, epoch: int) -> None:
    """An epoch's line in ``epochs.jsonl`` from its step lines in ``metrics.jsonl``."""
    steps = [m for m in read_metrics(run_dir / "metrics.jsonl") if m.get("epoch") == epoch]
    append_metrics(run_dir / "epochs.jsonl", epoch_aggregate(steps))


def save_final(config: RunConfig, trainer, tokenizer) -> None:
    """The trained policy as an HF folder (``run_dir/final``): weights and tokenizer, what an
    engine needs."""
    import ray

    ray.get(trainer.save_pretrained.remote(str(config.run_dir / "final"), dtype=config.engine.dtype))
    tokenizer.save_pretrained(str(config.run_dir / "final"))
