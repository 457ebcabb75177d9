"""The RL loop, top to bottom: assign -> generate -> score -> rewards to history -> train -> sync.

``run(config)`` starts Ray (if needed), one ``Trainer`` and ``engine.num_engines``
``RolloutActor``s, then for each epoch:

1. predict each prompt group's response length (``rhyme_predict_lengths`` on the engine that
   served it last epoch; ``rollout.default_predicted_length`` otherwise) and assign whole
   groups to engines (LPT with history affinity, or round-robin);
2. generate G samples per prompt (overrunning requests migrate to idle engines; a dead
   engine is restarted from its snapshot and its unfinished requests re-issued);
3. score each response with ``task.reward_fn``;
4. send the rewards to the engines' RHYME history (``rhyme_set_rewards``), and give each
   prompt's home engine the full responses migration or a restart kept out of its history
   (``pool.forward_full_responses``);
5. GRPO update on the trainer;
6. sync weights trainer -> engines (the history epoch advances with the new weights);
7. snapshot histories, checkpoint the trainer, append metrics (JSONL) and the trace.

``run(config, resume=True)`` continues from the last finished epoch of ``runs/<name>``.
Each phase is one call: :mod:`rl_driver.phases` holds them, :mod:`rl_driver.stack` the actors
(start, resume, restart, shutdown), :mod:`rl_driver.metrics` the epoch's metrics and files.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional

from rl_driver import phases
from rl_driver.config import RunConfig
from rl_driver.metrics import TraceLog, append_metrics, epoch_metrics, open_run_dir
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
    """Run (or resume) the loop; returns the per-epoch metrics of this invocation.

    ``on_epoch(metrics)`` is called after each epoch; ``on_rollout_start(epoch, pool)`` once
    an epoch's requests are all in flight (fault-injection tests use it); ``progress`` hears
    each phase's progress inside an epoch."""
    from rl_driver.warm_start import policy_path

    # setup: run dir, Ray, task, trainer + engines (+ the last finished epoch on resume)
    config = config.resolved()  # dtype / threads "auto" -> this machine's measured choice
    state = open_run_dir(config.run_dir, dataclasses.asdict(config), resume)
    start_ray(config)
    model_path = policy_path(config, log=logger.info)  # the warm start's folder when enabled
    task = phases.load_task(config, model_path)
    trace = TraceLog(config.run_dir / "trace.jsonl.gz", keep=resume, before_epoch=state.next_epoch)
    stack = start_stack(config, model_path, state, resume)
    pool, results = stack.pool, []
    try:
        for epoch in range(state.next_epoch, config.loop.epochs):
            # plan: whole prompt groups to engines by predicted load
            plan = phases.plan_epoch(config, pool, task.prompts, state.affinity)
            # generate G samples per prompt (a dead engine is restarted, its requests re-issued)
            rollout = phases.generate(
                config, pool, task, plan, tag=f"{config.name}/e{epoch}/",
                restart=lambda i: stack.restart(i, state.weight_version),
                after_submit=(lambda: on_rollout_start(epoch, pool)) if on_rollout_start else None,
                progress=progress)
            # reward, then rewards and full responses to the engines' history
            rewards = phases.score(task, rollout.jobs)
            fed = phases.feed_history(pool, rollout, rewards)
            # train
            train = phases.train(config, stack.trainer, rollout.jobs, rewards, progress)
            # sync weights; the trainer writes its checkpoint meanwhile (both only read weights)
            state.weight_version = int(train["version"])
            checkpoint = stack.start_checkpoint(config.loop.checkpoint)
            sync_s = phases.sync_weights(stack.sync, state.weight_version, progress)
            # snapshot histories; the checkpoint lands before the state that points past it
            pool.snapshot_all()
            wait(checkpoint)
            state.affinity = {pid: e for e, eng in enumerate(plan.assignment) for pid in eng}
            state.next_epoch = epoch + 1
            metrics = epoch_metrics(
                epoch, balance=config.rollout.balance, plan=plan, rollout=rollout,
                rewards=rewards, fed=fed, train=train, sync_s=sync_s, sync_method=stack.sync.method,
                rhyme_stats=pool.call_all("rhyme_stats"), snapshot_bytes=pool.snapshot_bytes,
                startup_s=stack.startup_s if epoch == state.first_epoch_of_process else 0.0,
                engine_nodes=stack.engine_nodes())
            # record: trace, metrics line, state
            record_epoch(config, trace, state, rollout, rewards, metrics)
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


def record_epoch(config: RunConfig, trace: TraceLog, state, rollout: phases.Rollout,
                 rewards: Dict[str, float], metrics: Dict[str, Any]) -> None:
    """The epoch's responses to the trace, its metrics line, then the state that points past
    it (``metrics.RunState``)."""
    if config.loop.trace:
        trace.add_epoch(metrics["epoch"], rollout.jobs, rewards)
    append_metrics(config.run_dir / "metrics.jsonl", metrics)
    state.save(config.run_dir)
    logger.info("epoch %d: reward %.3f, rollout %.1fs (%.0f tok/s, tau %.2f, bubble %.2f)",
                metrics["epoch"], metrics["mean_reward"], metrics["rollout_makespan_s"],
                metrics["tokens_per_s"], metrics["tau"], metrics["bubble_ratio"])


def save_final(config: RunConfig, trainer, tokenizer) -> None:
    """The trained policy as an HF folder (``run_dir/final``): weights and tokenizer, what an
    engine needs."""
    import ray

    ray.get(trainer.save_pretrained.remote(str(config.run_dir / "final"), dtype=config.engine.dtype))
    tokenizer.save_pretrained(str(config.run_dir / "final"))
