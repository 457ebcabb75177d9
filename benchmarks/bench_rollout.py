"""End-to-end rollout benchmark: vanilla SGLang vs SGLang NGRAM vs RHYME, side by side.

One run, one machine, the same reasoning-gym prompts (G samples each, temperature 1.0):

1. **Policy trajectory.** Epoch 0 is generated with vanilla SGLang on the base model; after
   every epoch one real GRPO step (``rl_driver.trainer.Trainer``, rewards from the task's
   scorer) produces the next policy, saved as a checkpoint. These checkpoints are the policy
   of epochs 1..E for every mode, so modes differ only in how they decode.
2. **Modes.** For each mode an engine starts fresh, generates epoch 0 on the base weights
   (this builds RHYME's history / NGRAM's corpus), then for each later epoch loads the epoch's
   checkpoint (``update_weights_from_disk``; RHYME's history epoch advances with it) and
   generates again. RHYME also gets the epoch's rewards. All requests of an epoch are
   submitted at once; makespan, output tokens/s, tau (tokens per verify step) and per-request
   latency p50/p99 are measured for epochs >= 1.
3. **Ordering.** With few running slots (``--ordering-max-running``), the final policy's
   rollout of a long/short prompt mix is timed with FCFS and with longest-predicted-first
   (both with the same one-epoch history of that mix, for the length predictions).

    python -m benchmarks.bench_rollout --model {tiny,smollm2} [--json OUT]

Prints one summary line with the speedup ratios and writes the JSON of the issue:
``{"modes": {...}, "speedup_vs_vanilla": {...}, "ordering": {...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("benchmarks.bench_rollout")
MODES = {
    "vanilla": {},
    "ngram": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8},
    "rhyme": {"speculative_algorithm": "RHYME", "speculative_num_draft_tokens": 8},
}


def build_prompts(model_path: str, num_prompts: int, datasets: list[str], seed: int):
    from transformers import AutoTokenizer

    from rl_driver.config import TaskConfig
    from rl_driver.tasks import build_prompts as task_prompts

    tok = AutoTokenizer.from_pretrained(model_path)
    per = max(1, num_prompts // len(datasets))
    prompts = []
    for name in datasets:
        prompts += task_prompts(TaskConfig(dataset=name, num_prompts=per), tok, seed)
    return prompts, tok


async def _timed_rollout(engine, prompts, group: int, max_new_tokens: int, seed: int):
    """Submit every (prompt, sample) at once; return per-request results with latencies."""
    start = time.perf_counter()

    async def one(prompt, sample):
        params = {"temperature": 1.0, "max_new_tokens": max_new_tokens,
                  "custom_params": {"rhyme_prompt_id": prompt.prompt_id, "rhyme_sample": sample}}
        out = await engine.async_generate(input_ids=prompt.token_ids, sampling_params=params,
                                          return_logprob=True)
        return {"prompt": prompt, "sample": sample, "ids": out["output_ids"],
                "meta": out["meta_info"], "latency": time.perf_counter() - start}

    results = await asyncio.gather(*(one(p, s) for p in prompts for s in range(group)))
    return results, time.perf_counter() - start


def summarize(results, makespan: float) -> dict:
    tokens = sum(len(r["ids"]) for r in results)
    verify = sum(r["meta"].get("spec_verify_ct", 0) or 0 for r in results)
    lat = sorted(r["latency"] for r in results)
    return {
        "makespan_s": makespan, "output_tokens": tokens, "tokens_per_s": tokens / makespan,
        "tau": tokens / verify if verify else 1.0,
        "latency_p50_s": statistics.median(lat), "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "mean_length": tokens / len(results),
    }


def score(results, tok, reward_fn) -> list[float]:
    return [reward_fn(r["prompt"], tok.decode(r["ids"]), r["ids"]) for r in results]


def grpo_samples(results, rewards, group: int):
    from rl_driver.grpo import group_advantages

    adv = group_advantages(rewards, group)
    return [{"prompt_ids": r["prompt"].token_ids, "response_ids": r["ids"],
             "logprobs": [lp for lp, _, _ in r["meta"]["output_token_logprobs"]],
             "advantage": a} for r, a in zip(results, adv)]


def run_mode(name, model_path, dtype, prompts, tok, args, checkpoints, trainer=None,
             snapshot: str | None = None):
    """One engine, epochs 0..E. With ``trainer``, also produces the checkpoints (vanilla)."""
    from rhyme_sglang import Engine
    from rl_driver.rewards import reasoning_gym_reward

    engine = Engine(model_path=model_path, dtype=dtype, log_level="error", **MODES[name])
    per_epoch = []
    try:
        for epoch in range(args.epochs + 1):
            if epoch > 0:
                ok, msg = engine.update_weights_from_disk(checkpoints[epoch])[:2]
                if not ok:
                    raise RuntimeError(f"weight update failed: {msg}")
            results, makespan = engine.loop.run_until_complete(
                _timed_rollout(engine, prompts, args.group, args.max_new_tokens, args.seed))
            rewards = score(results, tok, reasoning_gym_reward)
            stats = summarize(results, makespan)
            stats["mean_reward"] = sum(rewards) / len(rewards)
            per_epoch.append(stats)
            logger.info("%s epoch %d: %s", name, epoch, json.dumps({k: round(v, 3) for k, v in stats.items()}))
            if name == "rhyme":
                engine.rhyme_set_rewards([{"rid": r["meta"]["id"], "reward": x}
                                          for r, x in zip(results, rewards)])
            if trainer is not None and epoch < args.epochs:
                trainer.train_step(grpo_samples(results, rewards, args.group))
                checkpoints[epoch + 1] = trainer.save_pretrained(
                    str(Path(args.workdir) / f"policy-{epoch + 1}"), dtype=dtype)
        if name == "rhyme":
            per_epoch[-1]["rhyme_stats"] = engine.rhyme_stats()
            if snapshot:
                engine.rhyme_save(snapshot)
    finally:
        engine.shutdown()
    later = per_epoch[1:]
    total_tokens = sum(e["output_tokens"] for e in later)
    total_time = sum(e["makespan_s"] for e in later)
    return {
        "epochs": per_epoch,
        "makespan_s": total_time,
        "tokens_per_s": total_tokens / total_time,
        "tau": statistics.mean(e["tau"] for e in later),
        "latency_p50_s": statistics.mean(e["latency_p50_s"] for e in later),
        "latency_p99_s": statistics.mean(e["latency_p99_s"] for e in later),
    }


def run_ordering(model_path, dtype, prompts, args, checkpoint, workdir) -> dict:
    group = args.ordering_group
    """FCFS vs LPT with few running slots on a long/short prompt mix.

    The FCFS engine first generates one untimed epoch (its history gives the length
    predictions), saves it, and is then timed; the LPT engine loads that snapshot."""
    from rhyme_sglang import Engine

    out, snapshot = {}, str(Path(workdir) / "ordering-history.snap")
    for policy in ("fcfs", "lpt"):
        engine = Engine(model_path=model_path, dtype=dtype, log_level="error",
                        max_running_requests=args.ordering_max_running, rhyme_schedule_policy=policy,
                        rhyme_snapshot_path=snapshot if policy == "lpt" else None, **MODES["rhyme"])
        try:
            engine.update_weights_from_disk(checkpoint)
            if policy == "fcfs":
                engine.loop.run_until_complete(
                    _timed_rollout(engine, prompts, group, args.max_new_tokens, args.seed))
                engine.rhyme_save(snapshot)
            _, makespan = engine.loop.run_until_complete(
                _timed_rollout(engine, prompts, group, args.max_new_tokens, args.seed))
        finally:
            engine.shutdown()
        out[f"{policy}_makespan_s"] = makespan
    out["lpt_speedup"] = out["fcfs_makespan_s"] / out["lpt_makespan_s"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rollout")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="epochs after epoch 0")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--datasets", default="chain_sum,basic_arithmetic")
    parser.add_argument("--ordering-datasets", default="chain_sum,gsm_symbolic")
    parser.add_argument("--ordering-max-running", type=int, default=4)
    parser.add_argument("--ordering-group", type=int, default=2)
    parser.add_argument("--modes", default="vanilla,ngram,rhyme")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from rhyme_sglang.models import resolve_model_path
    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    model_path = resolve_model_path(args.model)
    dtype = "float32" if args.model == "tiny" else "bfloat16"
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-rollout-")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if modes[0] != "vanilla":
        raise ValueError("--modes must start with vanilla (it produces the policy checkpoints)")
    prompts, tok = build_prompts(model_path, args.prompts, args.datasets.split(","), args.seed)
    checkpoints = {0: model_path}
    trainer = Trainer(model_path, TrainConfig(lr=args.lr, micro_batch_size=4), seed=args.seed)
    snapshot = str(Path(args.workdir) / "rhyme-history.snap")
    report = {"model": args.model, "prompts": len(prompts), "group": args.group,
              "epochs": args.epochs, "max_new_tokens": args.max_new_tokens, "modes": {}}
    for name in modes:
        report["modes"][name] = run_mode(
            name, model_path, dtype, prompts, tok, args, checkpoints,
            trainer=trainer if name == "vanilla" else None,
            snapshot=snapshot if name == "rhyme" else None)
        if name == "vanilla":
            del trainer  # free the trainer's memory before the other engines run
        _write(args.json, report)  # partial results survive an interrupted run
    base = report["modes"]["vanilla"]["makespan_s"]
    report["speedup_vs_vanilla"] = {m: base / r["makespan_s"] for m, r in report["modes"].items()
                                    if m != "vanilla"}
    if "rhyme" in modes and args.ordering_max_running > 0:
        mix, _ = build_prompts(model_path, args.prompts, args.ordering_datasets.split(","), args.seed + 1)
        report["ordering"] = run_ordering(model_path, dtype, mix, args, checkpoints[args.epochs],
                                          args.workdir)
    line = "bench_rollout %s: " % args.model + ", ".join(
        f"{m} {r['makespan_s']:.1f}s {r['tokens_per_s']:.0f} tok/s tau {r['tau']:.2f}"
        for m, r in report["modes"].items())
    line += " | speedup vs vanilla: " + ", ".join(f"{m} x{v:.2f}" for m, v in report["speedup_vs_vanilla"].items())
    if "ordering" in report:
        o = report["ordering"]
        line += f" | ordering: fcfs {o['fcfs_makespan_s']:.1f}s lpt {o['lpt_makespan_s']:.1f}s (x{o['lpt_speedup']:.2f})"
    print(line)
    _write(args.json, report)
    return 0


def _write(path, report) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
