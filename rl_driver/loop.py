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
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from rl_driver.balance import assign_groups, imbalance, predicted_makespan
from rl_driver.config import RunConfig
from rl_driver.dispatch import DispatchConfig, Dispatcher, Job
from rl_driver.grpo import group_advantages
from rl_driver.metrics import RunState, TraceLog, append_metrics, summarize_breakdown
from rl_driver.progress import ProgressSink, wait_train
from rl_driver.rewards import load_reward_fn
from rl_driver.tasks import build_prompts

logger = logging.getLogger(__name__)


def start_ray(config: RunConfig) -> None:
    import ray

    if not ray.is_initialized():
        kwargs = {"num_cpus": config.loop.ray_num_cpus} if config.loop.ray_num_cpus else {}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)


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


def run(config: RunConfig, resume: bool = False,
        on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
        on_rollout_start: Optional[Callable[[int, Any], None]] = None,
        progress: Optional[ProgressSink] = None) -> List[Dict[str, Any]]:
    """Run (or resume) the loop; returns the per-epoch metrics of this invocation.

    ``on_epoch(metrics)`` is called after each epoch; ``on_rollout_start(epoch, pool)`` once
    an epoch's requests are all in flight (fault-injection tests use it); ``progress`` hears
    each phase's progress inside an epoch."""
    import ray
    from transformers import AutoTokenizer

    from rl_driver.pool import EnginePool, forward_full_responses
    from rl_driver.trainer import Trainer
    from rl_driver.warm_start import policy_path
    from rl_driver.weight_sync import WeightSync

    config = config.resolved()  # dtype / threads "auto" -> this machine's measured choice
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    state = RunState.load(run_dir) if resume else RunState()
    if not resume:
        for stale in ("metrics.jsonl", "state.json"):
            (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.json").write_text(json.dumps(_as_dict(config), indent=2))
    start_ray(config)

    model_path = policy_path(config, log=logger.info)  # the warm start's folder when enabled
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_prompts(config.task, tokenizer, config.seed)
    by_id = {p.prompt_id: p for p in prompts}
    reward_fn = load_reward_fn(config.task.reward_fn)
    group = config.rollout.group_size
    trace = TraceLog(run_dir / "trace.jsonl.gz", keep=resume, before_epoch=state.next_epoch)

    t_start = time.time()
    # num_cpus=0: Ray must not refuse --num-engines N > cores (the OS shares the CPUs)
    trainer = ray.remote(Trainer).options(num_cpus=0, max_concurrency=2).remote(model_path, config.train, config.seed)
    pool = EnginePool(config.engine.server_args(model_path), config.engine.num_engines,
                      rhyme=config.engine.rhyme, snapshot_dir=str(run_dir / "snapshots"))
    ray.get(trainer.ready.remote())
    sync = WeightSync(trainer, pool, method=config.sync.method, bucket_mb=config.sync.bucket_mb,
                      engine_dtype=config.engine.dtype, backend=config.sync.backend,
                      master_address=config.sync.master_address, disk_dir=str(run_dir / "weights"))
    if resume and state.next_epoch > 0:
        ray.get(trainer.load_checkpoint.remote(str(run_dir / "ckpt" / "trainer.pt")))
        sync.sync(state.weight_version)
        for i, a in enumerate(pool.actors):
            path = pool.snapshot_path(i)
            if config.engine.rhyme and path and Path(path).exists():
                ray.get(a.rhyme_load.remote(path))
        logger.info("resumed %s at epoch %d (weights v%d)", config.name, state.next_epoch,
                    state.weight_version)
    startup_s = time.time() - t_start

    def restart(i: int) -> None:
        pool.restart(i, weights_loader=lambda actor: sync.sync(state.weight_version, [actor]))

    dispatch_config = DispatchConfig(
        sampling_params=config.rollout.sampling_params(), migrate=config.rollout.migrate,
        overrun_factor=config.rollout.overrun_factor,
        poll_interval_s=config.rollout.poll_interval_s,
        max_restarts=config.loop.max_actor_restarts)
    results = []
    try:
        for epoch in range(state.next_epoch, config.loop.epochs):
            # 1. assign whole prompt groups to engines by predicted load
            predicted = predict_lengths(pool, prompts, state.affinity,
                                        config.rollout.default_predicted_length)
            ids = [p.prompt_id for p in prompts]
            load = {pid: predicted[pid] * group for pid in ids}
            assignment = assign_groups(ids, [load[i] for i in ids], pool.num_engines,
                                       config.rollout.balance, state.affinity)
            rr = assign_groups(ids, [load[i] for i in ids], pool.num_engines, "round_robin")

            # 2. generate G samples per prompt
            jobs = [[Job(prompt_id=pid, sample=s, prompt_ids=list(by_id[pid].token_ids),
                         predicted=predicted[pid], max_new_tokens=config.rollout.max_new_tokens)
                     for pid in eng for s in range(group)] for eng in assignment]
            dispatcher = Dispatcher(
                pool, dispatch_config, tag=f"{config.name}/e{epoch}/", restart=restart,
                after_submit=(lambda: on_rollout_start(epoch, pool)) if on_rollout_start else None,
                on_progress=progress.rollout if progress else None)
            pool.call_all("rhyme_breakdown", reset=True)
            rollout = dispatcher.run(jobs)
            breakdown = pool.call_all("rhyme_breakdown", reset=True)
            done = sorted(rollout.jobs, key=lambda j: (ids.index(j.prompt_id), j.sample))

            # 3. score
            rewards = {j.key: float(reward_fn(by_id[j.prompt_id],
                                              tokenizer.decode(j.response_ids, skip_special_tokens=True),
                                              j.response_ids)) for j in done}

            # 4. rewards to the engines' history
            rewarded = send_rewards(pool, done, rewards, dispatcher.generation)
            forwarded = forward_full_responses(pool.actors, done, rewards, dispatcher.generation)

            # 5. train
            advantages = group_advantages([rewards[j.key] for j in done], group,
                                          eps=config.train.adv_eps)
            samples = [{"prompt_ids": j.prompt_ids, "response_ids": j.response_ids,
                        "logprobs": j.logprobs, "advantage": float(a)}
                       for j, a in zip(done, advantages)]
            train_metrics = wait_train(trainer, trainer.train_step.remote(samples), progress)

            # 6. sync weights (the engines' history epoch advances with the new weights);
            # the trainer writes its checkpoint meanwhile (both only read its weights)
            state.weight_version = int(train_metrics["version"])
            checkpoint = (trainer.save_checkpoint.remote(str(run_dir / "ckpt" / "trainer.pt"))
                          if config.loop.checkpoint else None)
            if progress:
                progress.sync(None)
            sync_s = sync.sync(state.weight_version)
            if progress:
                progress.sync(sync_s)

            # 7. snapshot, checkpoint, metrics, trace
            pool.snapshot_all()
            if checkpoint is not None:
                ray.get(checkpoint)  # written before the state that points past this epoch
            rhyme_stats = pool.call_all("rhyme_stats")
            state.affinity = {pid: e for e, eng in enumerate(assignment) for pid in eng}
            state.next_epoch = epoch + 1
            if config.loop.trace:
                trace.add_epoch(epoch, done, rewards)
            metrics = {
                "epoch": epoch,
                "mean_reward": sum(rewards.values()) / len(rewards),
                "rollout_makespan_s": rollout.stats["makespan_s"],
                "tokens_per_s": rollout.stats["tokens_per_s"],
                "response_tokens": rollout.stats["response_tokens"],
                "mean_response_len": rollout.stats["response_tokens"] / len(done),
                "tau": rollout.stats["tau"],
                "bubble_ratio": rollout.stats["bubble_ratio"],
                "engine_busy_s": rollout.stats["engine_busy_s"],
                "migrations": rollout.stats["migrations"],
                "restarts": rollout.stats["restarts"],
                "reissued": rollout.stats["reissued"],
                "balance": config.rollout.balance,
                "predicted_makespan": predicted_makespan(assignment, load),
                "predicted_makespan_round_robin": predicted_makespan(rr, load),
                "predicted_imbalance": imbalance(assignment, load),
                "predicted_imbalance_round_robin": imbalance(rr, load),
                "train_time_s": train_metrics["train_time_s"],
                "sync_time_s": sync_s,
                "sync_method": sync.method,
                "rewards_sent": rewarded, "responses_forwarded": forwarded,
                "history_epoch": [s.get("epoch") for s in rhyme_stats],
                "history_responses": [s.get("num_responses") for s in rhyme_stats],
                "history_memory_bytes": [s.get("memory_bytes") for s in rhyme_stats],
                # per engine: ok, calibration_at_bound or verify_starved (core/health.py)
                "speculation_health": [s.get("speculation_health", {}).get("status")
                                       for s in rhyme_stats],
                "train": {k: v for k, v in train_metrics.items() if k != "train_time_s"},
                "breakdown": [summarize_breakdown(b) for b in breakdown],
                "timeline": {str(e): [[s - rollout.stats["start_s"], t - rollout.stats["start_s"]]
                                      for s, t in iv] for e, iv in rollout.busy.items()},
                "startup_s": startup_s if epoch == state.first_epoch_of_process else 0.0,
            }
            append_metrics(run_dir / "metrics.jsonl", metrics)
            state.save(run_dir)
            results.append(metrics)
            logger.info("epoch %d: reward %.3f, rollout %.1fs (%.0f tok/s, tau %.2f, bubble %.2f)",
                        epoch, metrics["mean_reward"], metrics["rollout_makespan_s"],
                        metrics["tokens_per_s"], metrics["tau"], metrics["bubble_ratio"])
            if on_epoch is not None:
                on_epoch(metrics)
        if config.loop.save_final and results:
            ray.get(trainer.save_pretrained.remote(str(run_dir / "final"),
                                                   dtype=config.engine.dtype))
            tokenizer.save_pretrained(str(run_dir / "final"))  # an engine needs both
    finally:
        pool.shutdown()
        try:
            ray.kill(trainer)
        except Exception:
            pass
    if config.loop.trace:
        trace.write_meta(model=config.model, config=_as_dict(config), metrics=results)
    return results


def _as_dict(config: RunConfig) -> Dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(config)
