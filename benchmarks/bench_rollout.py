"""End-to-end rollout benchmark, shaped like RL: vanilla SGLang vs NGRAM vs RHYME, side by side.

One run, one machine, one policy trajectory for every mode:

0. **Workload (``--policy``).** ``warm_start`` (the default): the policy is the SFT warm start
   of preset ``--task`` (``rl_driver.task_presets``; ``rl_driver.warm_start.ensure`` on the
   ``--model`` base with ``WarmStartConfig(task=--task)``: the cached folder, else built once,
   about 8 minutes on 2 cores) and the prompts are ``--prompts`` (one total count) of that
   preset's items, sizes from its long-tailed mix (``rl_driver.tasks.preset_prompts``), so the
   responses are the task's procedure and mostly stop on their own. ``base``: the earlier
   workload, kept so its results stay reproducible: the base model on the
   ``--datasets`` mix, ``--prompts`` per dataset.
1. **Trajectory (vanilla).** The prompts, ``--group`` samples each up to ``--max-new-tokens``,
   temperature 1.0, all submitted at once as a synchronous RL step does. After every epoch one
   real GRPO step (``rl_driver.trainer.Trainer``, from the policy's folder; rewards from the
   task's scorer, ``rl_driver.rewards.reasoning_gym_reward``) makes the next policy checkpoint
   (its epochs' timings are kept as ``"trajectory"``).
2. **Timed modes, interleaved.** Epochs >= ``--timed-from`` are timed again for every mode,
   vanilla included, one fresh engine per (mode, epoch), in an order that alternates: the
   modes in ``--modes`` order for the first timed epoch, reversed for the next, and so on
   (``--repeats`` R times each epoch; ``schedule``). The machine's speed drifts (the
   same epoch can take 50% longer an hour later), and a fixed order favours the mode that
   runs later; an alternating order gives every mode the same mean position, and vanilla is no
   longer timed only at the start, where the trajectory times it (its timings stay in the
   report under ``"trajectory"``). Each engine gets the history of epochs < its epoch without
   generating it (outputs are distributed alike in every mode): RHYME modes import the
   trajectory's responses and rewards (``rhyme_import_history``); NGRAM's n-gram trie is
   seeded with the same responses (``Engine.ngram_seed``: the windows its online path would
   have inserted had it served them). Each RHYME mode keeps its own saved step costs
   (``$RHYME_STEP_COSTS`` in the work directory) across its epochs, as one long-lived engine
   would, and every RHYME mode's first run starts from the same copy of this machine's saved
   table, so no mode starts warmer than another. Then the engine loads that epoch's
   checkpoint and generates all requests at once. ``rhyme`` chooses with the cost model,
   per step, which
   draft nodes of which requests to verify (per-request widths up to 16, plain when none
   pays); ``rhyme_fixed`` verifies every request's drafts up to 8 tokens (no cost model);
   ``rhyme_batch_width`` (not in the default ``--modes``) is ``rhyme`` with one width per
   step for the whole batch (``rhyme_ragged=False``).
   **Same answers.** With ``--sampling-seeds shared`` (the default) request (epoch, prompt,
   sample) carries the same ``sampling_seed`` in every mode, and every mode draws a seeded
   request's tokens alike (speculation keeps them: ``cpu_backend/sampling.py``), so every mode
   decodes the same answers and the makespans compare the same work; at temperature 1.0 the
   answers' lengths otherwise move a makespan more than the schedule does. ``none``: each mode samples its own answers.
3. **Report.** Per mode and epoch: makespan (last finish), time to 90% finished, output tok/s,
   ``same_tokens_as_vanilla`` (the share of requests whose tokens equal the trajectory's),
   tau (tokens per decode step of a request), decode steps by kind and the scheduler's time
   breakdown (``Engine.rhyme_breakdown``: prefill, decode by kind, draft lookups, result
   processing, scheduling, idle). ``speedup_vs_vanilla`` is the makespan ratio summed over
   epochs >= ``--timed-from`` (each epoch's makespan the mean of its ``--repeats``).

``--ordering`` adds the FCFS vs longest-predicted-first experiment (``benchmarks.bench_ordering``;
``--ordering-only`` runs just that, on the base model and without a ``"workload"`` key).
``--quick`` is a small version (``QUICK[policy]``; sized for 10-15 minutes on a 2-core CPU once
the warm start is cached).

    python -m benchmarks.bench_rollout [--quick] [--policy warm_start|base] [--task NAME]
                                       [--json OUT]

JSON: ``{"modes": {NAME: {...}}, "speedup_vs_vanilla": {...}, "per_epoch": {NAME: [...]},
"breakdown": {NAME: [...]}, "requests": {NAME: [...]}, "runs": [...], "trajectory": {...},
"wall_s": {"warm_start", "trajectory", NAME..., "total"}, "workload": {...}, "datasets": ...,
...}`` (``per_epoch`` / ``breakdown`` hold one entry per timed run, with its ``round``; ``runs``
lists the timed runs in the order they ran, ``started_s`` counted from the trajectory's start;
``datasets``: ``--datasets``, or the preset's reasoning-gym dataset; ``trajectory`` holds the
trajectory's own per-epoch figures and trace; ``wall_s``: the benchmark's own wall time by
part: finding or building the warm start, the trajectory with its GRPO steps, each mode's runs
with their engine starts and history); ``requests`` lists each timed request's (epoch,
prompt_id, sample, length, latency) for the rollout simulator (first round).

``workload`` (``workload_block``): ``{"policy": "warm_start"|"base", "task": the preset, or
the --datasets joined by commas, "warm_start": {"recipe": the WarmStartConfig's fields,
"folder": the folder's name, "eval": its held-out evaluation or null, "seconds": its training
seconds or null (both from the folder's warm_start.json)} or null for base, "trace_stats":
benchmarks.trace_stats.epoch_stats of the trajectory's trace (one row per epoch: responses,
mean reward, length mean / median / max / tail ratio, capped, reuse vs the epoch before)}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import epoch_total, write_json
from benchmarks.rollout_requests import (  # noqa: F401 (MODES, timed_pairs re-exported)
    MODES, build_prompts, grpo_samples, load_checkpoint, timed_pairs)
from rhyme_sglang.settings import prepare_cpu_env

logger = logging.getLogger("benchmarks.bench_rollout")
# --prompts by policy: one count per --datasets entry (base), one total count (warm_start)
DEFAULT_PROMPTS = {"base": "12,4", "warm_start": "8"}
# the small version, by --policy. base: 3 chain_sum + 1 gsm_symbolic prompt x 4 samples (the
# long tail is the gsm group). Measured on a 2-core avx2 CPU, fp32: 24 min at 4+2 prompts and a
# 384-token cap, 11:50 at 3+1 and 256 tokens (each epoch's makespan is its longest answer, up to
# the cap); so 192: 11:08-11:09 with the trainer padding every response, 7:52 with packed
# responses.
# warm_start: 3 prompts x 4 samples, the same 3 epochs and 2 repeats (11 generation epochs, 11
# engine starts, 2 GRPO steps). running_sum's 3 prompts at seed 0 (sizes stratified over the
# mix) have 4, 34 and 20 terms, whose worked solutions are ~50, ~440 and ~260 tokens, so the cap
# of 640 lets every answer stop on its own and the 34-term group is the tail the makespan waits
# for, at a batch of 4.
# a dataset-scale run (--dataset-prompts): 2 passes over the dataset, 4 samples a prompt, the
# running-sum warm start's answers stop on their own below 640 tokens
SCALE_DEFAULTS = {"epochs": 2, "group": 4, "max_new_tokens": 640,
                  "modes": "vanilla,ngram,rhyme,rhyme_per_step,rhyme_run_ahead"}
QUICK = {"base": {"prompts": "3,1", "group": 4, "epochs": 3, "max_new_tokens": 192, "repeats": 2},
         "warm_start": {"prompts": "3", "group": 4, "epochs": 3, "max_new_tokens": 640,
                        "repeats": 2}}


def resolve_policy(args, log=print) -> tuple:
    """``(folder, recipe)``: the folder the trajectory starts from and its warm-start recipe.
    ``--policy base``: the ``--model`` folder and None; ``warm_start``: the warm start of
    ``--task`` on it (``WarmStartConfig(task=--task)``), reused from the models cache or built
    there once; one line says which."""
    from rhyme_sglang.models import resolve_model_path
    from rl_driver import warm_start
    from rl_driver.config import WarmStartConfig

    base = resolve_model_path(args.model)
    if args.policy == "base":
        return base, None
    recipe = WarmStartConfig(task=args.task)
    folder = warm_start.output_dir(base, recipe)
    cached = (folder / ".complete").exists()
    log(f"bench_rollout: policy = the {args.task} warm start of {Path(base).name}: "
        + (f"cached, {folder}" if cached else f"not cached, building it once into {folder} "
           "(about 8 min on 2 cores)"))
    return str(warm_start.ensure(base, recipe)), recipe


def workload_prompts(model_path: str, args):
    """``(prompts, tokenizer)`` of the run. ``base``: ``--prompts`` (one count per dataset) of
    the ``--datasets`` mix (``build_prompts``); ``warm_start``: ``--prompts`` (one total count)
    of preset ``--task`` (``rl_driver.tasks.preset_prompts``), seed ``--seed`` both."""
    if args.policy == "base":
        counts = [int(c) for c in str(args.prompts).split(",")]
        return build_prompts(model_path, counts, args.datasets.split(","), args.seed)
    from transformers import AutoTokenizer

    from rl_driver.config import TaskConfig
    from rl_driver.tasks import preset_prompts

    tok = AutoTokenizer.from_pretrained(model_path)
    cfg = TaskConfig(preset=args.task, num_prompts=int(args.prompts))
    return preset_prompts(cfg, tok, args.seed), tok


def _datasets(args) -> str:
    """The reasoning-gym datasets the prompts come from (``--datasets``, or the preset's)."""
    from rl_driver.task_presets import PRESETS

    return args.datasets if args.policy == "base" else PRESETS[args.task].dataset


def workload_block(args, folder, recipe, records) -> dict:
    """The report's ``"workload"`` (module docstring): ``folder`` / ``recipe`` from
    ``resolve_policy``, ``records`` the trajectory's trace records (``trace_stats`` rows)."""
    from benchmarks.trace_stats import epoch_stats

    warm = None
    if recipe is not None:
        path = Path(folder) / "warm_start.json"
        info = json.loads(path.read_text()) if path.is_file() else {}
        warm = {"recipe": dataclasses.asdict(recipe), "folder": Path(folder).name,
                "eval": info.get("eval"), "seconds": (info.get("training") or {}).get("seconds")}
    task = args.task if recipe is not None else ",".join(
        d.strip() for d in args.datasets.split(","))
    return {"policy": args.policy, "task": task, "warm_start": warm,
            "trace_stats": epoch_stats(records)}


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


def _epoch_stats(results, makespan, rewards) -> dict:
    stats = summarize(results, makespan)
    done = sorted(r["latency"] for r in results)
    stats["t90_s"] = done[max(0, int(0.9 * len(done)) - 1)]
    stats["mean_reward"] = sum(rewards) / len(rewards)
    return stats


def _generate_epoch(engine, prompts, args, epoch: int):
    pairs = [(p, k) for p in prompts for k in range(args.group)]
    from rl_driver.tasks import sampling_seed

    seeds = None if args.sampling_seeds == "none" else {
        (p.prompt_id, k): sampling_seed(args.seed, epoch, p.prompt_id, k) for p, k in pairs}
    return engine.loop.run_until_complete(
        timed_pairs(engine, pairs, args.max_new_tokens, return_logprob=True, seeds=seeds))


def _same_tokens(results, vanilla) -> float:
    """The share of requests whose tokens equal vanilla's (same epoch, prompt and sample)."""
    ref = {(prompt.prompt_id, sample): ids for prompt, sample, ids, _ in vanilla}
    return sum(r["ids"] == ref.get((r["prompt"].prompt_id, r["sample"])) for r in results) / len(results)


def _record_epoch(engine, name, epoch, results, makespan, rewards, report, round_=0,
                  **extra) -> dict:
    """One timed epoch of ``name`` (``"trajectory"``: the trajectory's own): its figures,
    breakdown, and (first round only) its requests and trace."""
    stats = dict(_epoch_stats(results, makespan, rewards), **extra)
    breakdown = engine.rhyme_breakdown(reset=True)
    stats["decode_steps"] = {k: v["steps"] for k, v in breakdown["decode"].items()}
    report["per_epoch"].setdefault(name, []).append(dict(stats, epoch=epoch, round=round_))
    report["breakdown"].setdefault(name, []).append(dict(breakdown, epoch=epoch, round=round_))
    if round_ == 0:
        report["requests"].setdefault(name, []).extend(
            {"epoch": epoch, "prompt_id": r["prompt"].prompt_id, "sample": r["sample"],
             "length": len(r["ids"]), "latency_s": r["latency"]} for r in results)
        _TRACES.setdefault(name, []).extend(_trace_records(epoch, results, rewards))
    logger.info("%s epoch %d round %d: %s", name, epoch, round_,
                json.dumps({k: round(v, 3) for k, v in stats.items() if isinstance(v, float)}))
    return stats


_TRACES: dict = {}  # mode -> its responses as trace records (for the rollout simulator)


def _trace_records(epoch, results, rewards) -> list:
    from rhyme_sglang.core import TraceRecord

    out = []
    for r, x in zip(results, rewards):
        reason = (r["meta"].get("finish_reason") or {}).get("type", "stop")
        out.append(TraceRecord(prompt_id=r["prompt"].prompt_id, epoch=epoch, sample=r["sample"],
                               prompt_token_ids=list(r["prompt"].token_ids),
                               response_token_ids=list(r["ids"]), reward=float(x),
                               finish_reason="length" if reason == "length" else "stop"))
    return out


def _write_traces(json_path, report) -> None:
    """Each mode's responses as a trace next to the JSON, with the trajectory's epochs it
    got as history, named in ``report["modes"][m]["trace"]``; the trajectory's own in
    ``report["trajectory"]["trace"]``."""
    from rhyme_sglang.core import write_trace

    if not json_path:
        return
    base = Path(json_path)
    history = [r for r in _TRACES.get("trajectory", []) if r.epoch < report["timed_from"]]
    for name, records in _TRACES.items():
        path = base.with_name(f"{base.stem}.{name}.trace.jsonl.gz")
        if name == "trajectory":
            write_trace(str(path), records)
            report["trajectory"]["trace"] = path.name
            continue
        write_trace(str(path), history + records)
        report["modes"].setdefault(name, {})["trace"] = path.name


def trajectory(model_path, dtype, prompts, tok, args, report) -> tuple:
    """Vanilla epochs 0..E-1 with a GRPO step after each: checkpoints and the trace."""
    from rhyme_sglang import Engine
    from rl_driver.config import TrainConfig
    from rl_driver.rewards import reasoning_gym_reward
    from rl_driver.trainer import Trainer

    trainer = Trainer(model_path, TrainConfig(lr=args.lr, micro_batch_size=4), seed=args.seed,
                      engine_dtype=args.dtype)
    checkpoints, trace = {0: model_path}, []
    engine = Engine(model_path=model_path, dtype=dtype, log_level="error",
                    max_running_requests=args.max_running,
                    max_total_tokens=args.max_total_tokens, **MODES["vanilla"])
    try:
        for epoch in range(args.epochs):
            if epoch > 0:
                load_checkpoint(engine, checkpoints[epoch])
            engine.rhyme_breakdown(reset=True)  # the window is this epoch's rollout alone
            results, makespan = _generate_epoch(engine, prompts, args, epoch)
            rewards = score(results, tok, reasoning_gym_reward)
            _record_epoch(engine, "trajectory", epoch, results, makespan, rewards, report)
            trace.append([(r["prompt"], r["sample"], r["ids"], x) for r, x in zip(results, rewards)])
            if epoch + 1 < args.epochs:
                t0 = time.perf_counter()
                trainer.train_step(grpo_samples(results, rewards, args.group))
                checkpoints[epoch + 1] = trainer.save_pretrained(
                    str(Path(args.workdir) / f"policy-{epoch + 1}"), dtype=dtype)
                logger.info("GRPO step %d: %.1fs", epoch, time.perf_counter() - t0)
    finally:
        engine.shutdown()
    return checkpoints, trace


def _import_history(engine, trace, before_epoch: int) -> int:
    """Give a RHYME engine the trajectory's responses and rewards of epochs < before_epoch,
    with the store's epoch at before_epoch - 1 (the next weight load advances it)."""
    from rhyme_sglang.core.transfer import states_from_responses

    for _ in range(before_epoch - 1):
        engine.rhyme_advance_epoch()
    states = states_from_responses(
        (prompt.prompt_id, prompt.token_ids, epoch, sample, ids, reward)
        for epoch in range(before_epoch) for prompt, sample, ids, reward in trace[epoch])
    return sum(engine.rhyme_import_history(state)["added"] for state in states)


def schedule(modes, first: int, epochs: int, repeats: int = 1) -> list:
    """The timed runs in the order they run: ``[(epoch, round, mode), ...]``. Each epoch's
    rounds run back to back; the modes run in ``modes`` order in even slots and reversed in
    odd ones (slot = the round's index over all epochs), so with drift that is linear in time
    every mode's mean position is the same over any two consecutive slots."""
    if repeats < 1 or not modes or not 0 <= first < epochs:
        raise ValueError(f"need repeats >= 1, modes and 0 <= first < epochs, got {repeats}, "
                         f"{modes!r}, {first}, {epochs}")
    out, slot = [], 0
    for epoch in range(first, epochs):
        for round_ in range(repeats):
            order = list(modes) if slot % 2 == 0 else list(reversed(modes))
            out += [(epoch, round_, m) for m in order]
            slot += 1
    return out


def _step_cost_files(modes, workdir) -> dict:
    """``{mode: file}``: each RHYME mode's own saved step costs, all copied from this
    machine's saved table (when there is one) so that no mode starts warmer than another."""
    import shutil

    from rhyme_sglang.sglang_ext.step_costs import cache_path

    folder = Path(workdir) / "step_costs"
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in modes:
        if name.startswith("rhyme"):
            out[name] = folder / f"{name}.json"
            if cache_path().is_file():
                shutil.copyfile(cache_path(), out[name])
    return out


def timed_run(name, epoch, round_, model_path, dtype, prompts, tok, args, checkpoints, trace,
              report, step_costs=None) -> dict:
    """One timed epoch of one mode on a fresh engine with the history of earlier epochs."""
    from rhyme_sglang import Engine
    from rl_driver.rewards import reasoning_gym_reward

    before = os.environ.get("RHYME_STEP_COSTS")
    if step_costs is not None:  # the engine's scheduler reads it when it starts
        os.environ["RHYME_STEP_COSTS"] = str(step_costs)
    engine = Engine(model_path=model_path, dtype=dtype, log_level="error",
                    max_running_requests=args.max_running,
                    max_total_tokens=args.max_total_tokens, **MODES[name])
    try:
        if name.startswith("rhyme"):
            added = _import_history(engine, trace, epoch)
            logger.info("%s: imported %d history responses of epochs < %d", name, added, epoch)
        elif name == "ngram":  # its trie gets what it would have learned serving them
            info = engine.ngram_seed((prompt.token_ids, ids) for e in range(epoch)
                                     for prompt, _, ids, _ in trace[e])
            logger.info("ngram: seeded its trie with %d responses of epochs < %d (%d windows)",
                        info["sequences"], epoch, info["windows"])
        load_checkpoint(engine, checkpoints[epoch])
        engine.rhyme_breakdown(reset=True)
        results, makespan = _generate_epoch(engine, prompts, args, epoch)
        rewards = score(results, tok, reasoning_gym_reward)
        stats = _record_epoch(engine, name, epoch, results, makespan, rewards, report, round_,
                              same_tokens_as_vanilla=_same_tokens(results, trace[epoch]))
        if name.startswith("rhyme"):
            report["modes"].setdefault(name, {})["rhyme_stats"] = {
                k: v for k, v in engine.rhyme_stats().items() if k != "breakdown"}
        return stats
    finally:
        engine.shutdown()
        if before is None:
            os.environ.pop("RHYME_STEP_COSTS", None)
        else:
            os.environ["RHYME_STEP_COSTS"] = before


def _mode_summary(runs: list) -> dict:
    """A mode's timed runs summed over epochs, each epoch the mean of its rounds."""
    by_epoch = {}
    for r in runs:
        by_epoch.setdefault(r["epoch"], []).append(r)

    tokens, time_s = epoch_total(runs, "output_tokens"), epoch_total(runs, "makespan_s")
    return {"makespan_s": time_s, "output_tokens": tokens, "tokens_per_s": tokens / time_s,
            "t90_s": epoch_total(runs, "t90_s"),
            "makespan_by_round": {str(e): [r["makespan_s"] for r in rs]
                                  for e, rs in sorted(by_epoch.items())},
            "tau": statistics.mean(r["tau"] for r in runs),
            "mean_reward": statistics.mean(r["mean_reward"] for r in runs),
            "same_tokens_as_vanilla": statistics.mean(r.get("same_tokens_as_vanilla", 1.0)
                                                      for r in runs),
            "epochs": sorted(by_epoch)}


def _ordering(model_path, dtype, checkpoint, args) -> dict:
    from benchmarks.bench_ordering import ordering_report

    return ordering_report(model_path, dtype, checkpoint, args)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with ``--prompts`` defaulting by ``--policy`` (``DEFAULT_PROMPTS``) and
    ``--quick`` filling ``QUICK[policy]``'s sizes where the command line does not set them."""
    from rl_driver.task_presets import PRESETS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rollout")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2",
                        help="the base model (warm_start: the one the warm start is made from)")
    parser.add_argument("--policy", choices=("warm_start", "base"), default="warm_start",
                        help="warm_start: the SFT warm start of --task on --model (cached, or "
                             "built once, ~8 min on 2 cores) with --task's prompts; base: "
                             "--model itself on the --datasets mix (the earlier workload)")
    parser.add_argument("--task", choices=list(PRESETS), default="running_sum",
                        help="--policy warm_start: the rl_driver.task_presets workload")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small version (10-15 min on 2 cores, warm start cached): {QUICK}")
    parser.add_argument("--prompts", default=None,
                        help="warm_start: prompts in total; base: prompts per dataset of "
                             f"--datasets (comma-separated); default {DEFAULT_PROMPTS}")
    parser.add_argument("--datasets", default="chain_sum,gsm_symbolic",
                        help="--policy base's task mix: short chain_sum answers, long "
                             "gsm_symbolic reasoning")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4, help="epochs 0..E-1")
    parser.add_argument("--timed-from", type=int, default=2,
                        help="first epoch every mode times (earlier ones give history)")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=64,
                        help="running requests per engine, the same for every mode")
    parser.add_argument("--max-total-tokens", type=int, default=0,
                        help="KV pool per engine in tokens; 0 = --max-running requests of the "
                             "longest prompt plus --max-new-tokens, so the batch is --max-running "
                             "and not the pool (SGLang reserves KV for max_new_tokens at admission)")
    parser.add_argument("--modes", default="vanilla,ngram,rhyme,rhyme_fixed")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of every mode per timed epoch (alternating order)")
    parser.add_argument("--ordering", action="store_true", help="also run the ordering experiment")
    parser.add_argument("--ordering-datasets", default="chain_sum,gsm_symbolic",
                        help="datasets of the ordering run's prompt mix (their lengths differ)")
    parser.add_argument("--ordering-prompts", default="10,1",
                        help="prompts per ordering dataset (comma-separated, same order)")
    parser.add_argument("--ordering-order", choices=("dataset", "shuffled"), default="dataset",
                        help="submission order of the prompt groups: datasets one after the "
                             "other, or a seeded random order per repeat")
    parser.add_argument("--ordering-max-running", type=int, default=8)
    parser.add_argument("--ordering-group", type=int, default=4)
    parser.add_argument("--ordering-max-new-tokens", type=int, default=384)
    parser.add_argument("--ordering-repeats", type=int, default=2)
    parser.add_argument("--ordering-only", action="store_true",
                        help="run only the ordering comparison (base model weights)")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--dtype", default="auto",
                        help="auto (measured: bf16 only where native) | float32 | bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampling-seeds", choices=("shared", "none"), default="shared",
                        help="shared: request (epoch, prompt, sample) draws with the same "
                             "sampling_seed in every mode, so every mode decodes the same tokens "
                             "(speculation keeps a seeded request's tokens) and the makespans "
                             "compare the same work; none: each mode samples its own answers")
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default=None)
    scale = parser.add_argument_group(
        "dataset scale (benchmarks.dataset_scale): steps of --prompts-per-step prompts sampled "
        "from --dataset-prompts, one GRPO update a step, --epochs passes over the dataset")
    scale.add_argument("--dataset-prompts", type=int, default=0,
                       help="the dataset's size (0: the epoch-shaped run above)")
    scale.add_argument("--prompts-per-step", type=int, default=16)
    scale.add_argument("--run-ahead-samples", type=int, default=2,
                       help="run-ahead responses per prompt of the next step")
    scale.add_argument("--run-ahead-below", type=int, default=16,
                       help="run-ahead starts once at most this many of the step's requests "
                            "are unfinished")
    scale.add_argument("--run-ahead-slots", type=int, default=8,
                       help="run-ahead requests in flight at a time")
    scale.add_argument("--sim-cost-table", default=str(
        Path(__file__).with_name("data") / "cost_h200_qwen2-7b.json"),
                       help="measured step costs for the first-visit simulation")
    args = parser.parse_args(argv)
    if args.dataset_prompts:  # the dataset-scale run's own defaults, where not given
        for key, value in SCALE_DEFAULTS.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        args.prompts = str(args.dataset_prompts)
    if args.quick:  # the small version's sizes, where the command line does not set them
        for key, value in QUICK[args.policy].items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.prompts is None:
        args.prompts = DEFAULT_PROMPTS[args.policy]
    if args.policy == "warm_start" and not str(args.prompts).isdigit():
        parser.error(f"--policy warm_start takes one total --prompts count, got {args.prompts!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    prepare_cpu_env()

    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.machine import cpu_flags
    from rhyme_sglang.models import resolve_model_path

    dtype = resolve_dtype(args.dtype)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-rollout-")
    if args.dataset_prompts:
        return dataset_scale_main(args, dtype)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "vanilla" not in modes or len(set(modes)) != len(modes):
        raise ValueError(f"--modes must name vanilla (the speedups' base) and other known modes "
                         f"{sorted(MODES)}, each once, got {args.modes!r}")
    if not 1 <= args.timed_from < args.epochs:
        raise ValueError(f"--timed-from must be in [1, --epochs), got {args.timed_from}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    report = {"model": args.model, "dtype": dtype, "cpu_flags": cpu_flags(),
              "prompts": args.prompts, "datasets": _datasets(args), "group": args.group,
              "epochs": args.epochs, "timed_from": args.timed_from, "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens,
              "config": {"num_engines": 1, "max_running_requests": args.max_running,
                         "num_draft_tokens": {m: MODES[m].get("speculative_num_draft_tokens")
                                              for m in modes}},
              "modes": {}, "per_epoch": {}, "breakdown": {}, "requests": {}, "runs": [],
              "trajectory": {}}
    if args.ordering_only:
        model_path = resolve_model_path(args.model)
        report["ordering"] = _ordering(model_path, dtype, model_path, args)
        o = report["ordering"]
        sim = o["simulated"]
        print(f"bench_rollout {args.model} ordering: fcfs {o['fcfs_makespan_s']:.1f}s "
              f"lpt {o['lpt_makespan_s']:.1f}s (x{o['lpt_speedup']:.2f}); simulated x"
              f"{sim.get('measured_curve', {}).get('lpt_speedup', float('nan')):.2f} with this "
              f"machine's step costs, x{sim.get('flat_curve', {}).get('lpt_speedup', float('nan')):.2f}"
              f" with a flat (GPU-like) step cost")
        write_json(args.json, report)
        return 0
    wall = report["wall_s"] = {}  # where the benchmark's own wall time went
    began = time.perf_counter()
    model_path, recipe = resolve_policy(args)
    wall["warm_start"] = time.perf_counter() - began
    prompts, tok = workload_prompts(model_path, args)
    if args.max_total_tokens <= 0:
        longest = max(len(p.token_ids) for p in prompts)
        args.max_total_tokens = args.max_running * (longest + args.max_new_tokens)
    report["config"]["max_total_tokens"] = args.max_total_tokens
    start = time.perf_counter()  # runs' started_s count from here
    checkpoints, trace = trajectory(model_path, dtype, prompts, tok, args, report)
    wall["trajectory"] = time.perf_counter() - start
    report["workload"] = workload_block(args, model_path, recipe, _TRACES["trajectory"])
    for key in ("per_epoch", "breakdown", "requests"):  # the trajectory's own, kept apart
        report["trajectory"][key] = report[key].pop("trajectory")
    write_json(args.json, report)
    step_costs = _step_cost_files(modes, args.workdir)
    for epoch, round_, name in schedule(modes, args.timed_from, args.epochs, args.repeats):
        t0 = time.perf_counter()
        stats = timed_run(name, epoch, round_, model_path, dtype, prompts, tok, args,
                          checkpoints, trace, report, step_costs.get(name))
        wall[name] = wall.get(name, 0.0) + time.perf_counter() - t0
        report["runs"].append({"epoch": epoch, "round": round_, "mode": name,
                               "started_s": t0 - start, "makespan_s": stats["makespan_s"]})
        write_json(args.json, report)  # partial results survive an interrupted run
    report["modes"] = {name: dict(report["modes"].get(name, {}),
                                  **_mode_summary(report["per_epoch"][name])) for name in modes}
    base = report["modes"]["vanilla"]["makespan_s"]
    report["speedup_vs_vanilla"] = {m: base / r["makespan_s"] for m, r in report["modes"].items()
                                    if m != "vanilla"}
    _write_traces(args.json, report)
    if args.ordering:
        report["ordering"] = _ordering(model_path, dtype, checkpoints[args.epochs - 1], args)
    wall["total"] = time.perf_counter() - began
    line = (f"bench_rollout {args.model} {args.policy} {report['workload']['task']} "
            f"({dtype}, {' '.join(report['cpu_flags'])}): ") + ", ".join(
        f"{m} {r['makespan_s']:.1f}s {r['tokens_per_s']:.0f} tok/s tau {r['tau']:.2f}"
        f" same tokens {100 * r['same_tokens_as_vanilla']:.0f}%"
        for m, r in report["modes"].items())
    line += " | trajectory (vanilla, timed first) %.1fs" % sum(
        e["makespan_s"] for e in report["trajectory"]["per_epoch"]
        if e["epoch"] >= args.timed_from)
    line += " | speedup vs vanilla (epochs >= %d): " % args.timed_from + ", ".join(
        f"{m} x{v:.2f}" for m, v in report["speedup_vs_vanilla"].items())
    line += " | wall " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in wall.items())
    print(line)
    write_json(args.json, report)
    return 0


def dataset_scale_main(args, dtype: str) -> int:
    """``--dataset-prompts``: the run of :mod:`benchmarks.dataset_scale`, its summary line and
    JSON (``"dataset_scale"``, ``"per_step"``, ``"modes"``, ``"plan"``, ``"trajectory"``,
    ``"workload"``, ``"wall_s"``)."""
    from benchmarks import dataset_scale
    from rhyme_sglang.machine import cpu_flags

    if args.policy != "warm_start":
        raise ValueError("--dataset-prompts runs on the warm-start policy (--policy warm_start)")
    logging.getLogger(dataset_scale.__name__).setLevel(logging.INFO)  # a line per step
    report = {"model": args.model, "dtype": dtype, "cpu_flags": cpu_flags(), "group": args.group,
              "epochs": args.epochs, "max_new_tokens": args.max_new_tokens,
              "config": {"num_engines": 1, "max_running_requests": args.max_running},
              "trajectory": {}, "wall_s": {}}
    began = time.perf_counter()
    model_path, recipe = resolve_policy(args)
    report["wall_s"]["warm_start"] = time.perf_counter() - began
    prompts, tok = workload_prompts(model_path, args)
    if args.max_total_tokens <= 0:
        longest = max(len(p.token_ids) for p in prompts)
        args.max_total_tokens = args.max_running * (longest + args.max_new_tokens)
    report["config"]["max_total_tokens"] = args.max_total_tokens
    report["workload"] = workload_block(args, model_path, recipe, [])  # trace_stats: run() sets
    dataset_scale.run(args, model_path, dtype, prompts, tok, report)
    print(dataset_scale.summary_line(report) + f" ({dtype}, {' '.join(report['cpu_flags'])})")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
