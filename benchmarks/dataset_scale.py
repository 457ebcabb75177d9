"""Rollout at dataset scale: steps are not epochs (``bench_rollout --dataset-prompts P
--prompts-per-step B``).

A dataset of P prompts, B a step, G samples each; every epoch a seeded shuffle (run seed +
epoch) cut into steps of B, one GRPO update after every step, so a prompt comes back P / B
updates after its last visit. The run, on one machine:

1. **Trajectory (vanilla).** Steps 0..S-1 with a GRPO step (``rl_driver.trainer.Trainer``,
   rewards from the task's scorer) after each, making checkpoint k + 1 from step k's
   responses. Step k's request (prompt, sample) draws with ``sampling_seed(seed, k, prompt,
   sample)`` in every mode, so every mode decodes the same answers from the same checkpoint
   (speculation keeps a seeded request's tokens) and the makespans compare the same work.
2. **Modes**, each one long-lived engine that runs every step in order, loading step k's
   checkpoint before it (the history epoch advances with the weights, so the store's recency
   counts policy updates):

   - ``vanilla``, ``ngram`` (SGLang's NGRAM, its trie filled by its own online path);
   - ``rhyme`` (``in_engine``): every prompt's history stays in the engine that made it;
   - ``rhyme_per_step`` (``per_step_load``): the engine holds only the step's prompts; before
     the step their records are imported from the driver's store (``rl_driver.history_store``,
     shards in the work directory), after it (rewards set) they are exported
     back and dropped from the engine (``rhyme_export_histories`` / ``rhyme_drop_history``);
   - ``rhyme_run_ahead``: ``rhyme_per_step`` plus run-ahead drafts: once no more than
     ``--run-ahead-below`` of the step's requests are unfinished, the engine also samples
     ``--run-ahead-samples`` responses of every prompt of the next step (``custom_params
     rhyme_run_ahead``, seeds apart from every real sample's), at most
     ``--run-ahead-slots`` at a time; all are aborted the moment the step's last real request
     finishes. Their tokens stay in the engine's history as draft-only records (exported and
     imported with the next step's prompts); the benchmark never scores or trains on them.
     On one engine sharing this CPU's cores, the run-ahead requests run in the same batch as
     the step's stragglers, so their cost to the stragglers is in this mode's makespan.

3. **Report** (``report["dataset_scale"]``): revisit tau (in_engine vs per_step_load),
   first-visit tau (siblings only vs run-ahead, over first-visit steps that have a step before
   them), the largest engine store (stats ``memory_bytes``) of each history mode, the transfer
   seconds a driver could not hide behind train + weight sync (``transfer_s_on_critical_path``:
   per step, export + import beyond the trajectory's measured train + checkpoint-load seconds,
   averaged over steps), the mean step seconds (rollout + train + load), and the first-visit
   speedup on the measured H200 step costs (``benchmarks.first_visit_sim``, on this run's
   trajectory trace), plus ``"per_step"`` rows: step, epoch, visit (first / revisit / mixed),
   updates since the prompts' last visit, and per mode the makespan, tau, import / export
   seconds and bytes, store bytes and run-ahead requests / tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import random
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.common import write_json
from benchmarks.rollout_requests import MODES, grpo_samples, load_checkpoint

logger = logging.getLogger("benchmarks.dataset_scale")

# the modes of a dataset-scale run: engine kwargs, and how the history is kept
SCALE_MODES = {
    "vanilla": (MODES["vanilla"], None),
    "ngram": (MODES["ngram"], None),
    "rhyme": (MODES["rhyme"], "in_engine"),
    "rhyme_per_step": (MODES["rhyme"], "per_step"),
    "rhyme_run_ahead": (MODES["rhyme"], "run_ahead"),
}
DEFAULT_MODES = "vanilla,ngram,rhyme,rhyme_per_step,rhyme_run_ahead"


def step_plan(prompt_ids: Sequence[str], per_step: int, epochs: int, seed: int) -> List[dict]:
    """``[{"step", "epoch", "prompts", "visit", "updates_since"}]``: each epoch a shuffle of
    ``prompt_ids`` seeded by ``seed`` + epoch, cut into steps of ``per_step`` (the last may be
    smaller). ``visit``: first (no prompt seen before), revisit (all seen) or mixed;
    ``updates_since``: steps since each revisited prompt's last visit (one update a step)."""
    if per_step < 1 or epochs < 1 or not prompt_ids:
        raise ValueError(f"need prompts, per_step >= 1 and epochs >= 1, got "
                         f"{len(prompt_ids)}, {per_step}, {epochs}")
    last: Dict[str, int] = {}
    out: List[dict] = []
    for epoch in range(epochs):
        order = list(prompt_ids)
        random.Random(seed + epoch).shuffle(order)
        for start in range(0, len(order), per_step):
            step, ids = len(out), order[start:start + per_step]
            gaps = [step - last[p] for p in ids if p in last]
            visit = "first" if not gaps else "revisit" if len(gaps) == len(ids) else "mixed"
            out.append({"step": step, "epoch": epoch, "prompts": ids, "visit": visit,
                        "updates_since": statistics.mean(gaps) if gaps else None})
            last.update((p, step) for p in ids)
    return out


def run_ahead_seed(seed: int, step: int, prompt_id: str, sample: int) -> int:
    """The sampling seed of run-ahead sample ``sample`` of ``prompt_id`` made during ``step``:
    hashed from a namespace no real sample's seed uses (``rl_driver.tasks.sampling_seed`` of an
    int step)."""
    from rl_driver.tasks import sampling_seed

    return sampling_seed(seed, f"run-ahead/{step}", prompt_id, sample)


async def _step_requests(engine, prompts, group: int, max_new_tokens: int, seeds: dict,
                         run_ahead: Optional[dict] = None):
    """Every (prompt, sample) of a step at once; with ``run_ahead`` ({"prompts", "samples",
    "below", "slots", "seed", "step", "max_new_tokens"}) also run-ahead requests for the next
    step's prompts once at most ``below`` real requests are unfinished, ``slots`` at a time,
    all aborted when the last real request finishes. Returns (results, makespan, run-ahead
    figures)."""
    start = time.perf_counter()
    unfinished = len(prompts) * group
    real_done = asyncio.Event()
    tail = asyncio.Event()
    if run_ahead is not None and unfinished <= run_ahead["below"]:
        tail.set()

    async def one(prompt, sample):
        nonlocal unfinished
        params = {"temperature": 1.0, "max_new_tokens": max_new_tokens,
                  "sampling_seed": seeds[prompt.prompt_id, sample],
                  "custom_params": {"rhyme_prompt_id": prompt.prompt_id, "rhyme_sample": sample}}
        out = await engine.async_generate(input_ids=prompt.token_ids, sampling_params=params,
                                          return_logprob=True)
        unfinished -= 1
        if run_ahead is not None and unfinished <= run_ahead["below"]:
            tail.set()
        if unfinished == 0:
            real_done.set()
        return {"prompt": prompt, "sample": sample, "ids": out["output_ids"],
                "meta": out["meta_info"], "latency": time.perf_counter() - start}

    ahead = {"requests": 0, "tokens": 0, "started_s": None, "abort_s": 0.0}

    async def run_ahead_loop():
        await tail.wait()
        if real_done.is_set():
            return
        ahead["started_s"] = time.perf_counter() - start
        todo = [(p, k) for k in range(run_ahead["samples"]) for p in run_ahead["prompts"]]
        running: Dict[str, asyncio.Task] = {}

        async def ahead_one(rid, prompt, k):
            params = {"temperature": 1.0, "max_new_tokens": run_ahead["max_new_tokens"],
                      "sampling_seed": run_ahead_seed(run_ahead["seed"], run_ahead["step"],
                                                      prompt.prompt_id, k),
                      "custom_params": {"rhyme_prompt_id": prompt.prompt_id, "rhyme_sample": k,
                                        "rhyme_run_ahead": True}}
            try:
                out = await engine.async_generate(input_ids=prompt.token_ids, rid=rid,
                                                  sampling_params=params)
                return len(out["output_ids"])
            except Exception as exc:  # an aborted request may end in an error on some paths
                logger.debug("run-ahead %s ended: %s", rid, exc)
                return 0

        n = 0
        while todo or running:
            while todo and len(running) < run_ahead["slots"] and not real_done.is_set():
                prompt, k = todo.pop(0)
                rid = f"run-ahead-{run_ahead['step']}-{n}"
                n += 1
                running[rid] = asyncio.ensure_future(ahead_one(rid, prompt, k))
                ahead["requests"] += 1
            if real_done.is_set():
                t0 = time.perf_counter()
                for rid, task in running.items():
                    if not task.done():
                        engine.tokenizer_manager.abort_request(rid)
                for task in running.values():
                    ahead["tokens"] += await task
                ahead["abort_s"] = time.perf_counter() - t0
                return
            waiter = asyncio.ensure_future(real_done.wait())
            done, _ = await asyncio.wait(list(running.values()) + [waiter],
                                         return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for rid in [r for r, t in running.items() if t.done()]:
                ahead["tokens"] += running.pop(rid).result()

    real = asyncio.gather(*(one(p, s) for p in prompts for s in range(group)))
    side = asyncio.ensure_future(run_ahead_loop()) if run_ahead is not None else None
    results = await real
    makespan = time.perf_counter() - start
    if side is not None:
        real_done.set()
        await side
    return results, makespan, ahead


def _tau(results) -> float:
    tokens = sum(len(r["ids"]) for r in results)
    verify = sum(r["meta"].get("spec_verify_ct", 0) or 0 for r in results)
    return tokens / verify if verify else 1.0


def _rewards(results, tok) -> List[float]:
    from rl_driver.rewards import reasoning_gym_reward

    return [float(reasoning_gym_reward(r["prompt"], tok.decode(r["ids"]), r["ids"]))
            for r in results]


def _seeds(args, step: dict, group: int) -> dict:
    from rl_driver.tasks import sampling_seed

    return {(p, k): sampling_seed(args.seed, step["step"], p, k)
            for p in step["prompts"] for k in range(group)}


def trajectory(engine_factory, model_path, dtype, by_id, plan, tok, args, report) -> tuple:
    """Vanilla steps with a GRPO update after each: ``(checkpoints, answers, trace records,
    train seconds per step)``; ``answers[step][(prompt, sample)]`` the token ids; a trace
    record's ``epoch`` is its step (the policy version that made it)."""
    from rhyme_sglang.core import TraceRecord
    from rl_driver.config import TrainConfig
    from rl_driver.trainer import Trainer

    trainer = Trainer(model_path, TrainConfig(lr=args.lr, micro_batch_size=4), seed=args.seed,
                      engine_dtype=args.dtype)
    checkpoints, answers, records, train_s = {0: model_path}, [], [], []
    engine = engine_factory("vanilla")
    try:
        for step in plan:
            k = step["step"]
            if k > 0:
                load_checkpoint(engine, checkpoints[k])
            prompts = [by_id[p] for p in step["prompts"]]
            results, makespan, _ = engine.loop.run_until_complete(_step_requests(
                engine, prompts, args.group, args.max_new_tokens, _seeds(args, step, args.group)))
            rewards = _rewards(results, tok)
            answers.append({(r["prompt"].prompt_id, r["sample"]): list(r["ids"]) for r in results})
            records += [TraceRecord(prompt_id=r["prompt"].prompt_id, epoch=k,
                                    sample=r["sample"], prompt_token_ids=list(r["prompt"].token_ids),
                                    response_token_ids=list(r["ids"]), reward=x,
                                    finish_reason=_finish(r))
                        for r, x in zip(results, rewards)]
            report["trajectory"].setdefault("per_step", []).append(
                {"step": k, "makespan_s": makespan, "mean_reward": statistics.mean(rewards),
                 "mean_length": statistics.mean(len(r["ids"]) for r in results)})
            t0 = time.perf_counter()
            if k + 1 < len(plan):
                trainer.train_step(grpo_samples(results, rewards, args.group))
                checkpoints[k + 1] = trainer.save_pretrained(
                    str(Path(args.workdir) / f"policy-{k + 1}"), dtype=dtype)
            train_s.append(time.perf_counter() - t0)
            logger.info("trajectory step %d (epoch %d, %s): %.1fs rollout, reward %.3f, "
                        "train %.1fs", k, step["epoch"], step["visit"], makespan,
                        statistics.mean(rewards), train_s[-1])
    finally:
        engine.shutdown()
    return checkpoints, answers, records, train_s


def _finish(result) -> str:
    reason = (result["meta"].get("finish_reason") or {}).get("type", "stop")
    return "length" if reason == "length" else "stop"


def run_mode(name, engine_factory, by_id, plan, checkpoints, answers, tok, args) -> List[dict]:
    """Every step of ``plan`` on one engine of mode ``name``: one row per step."""
    history_mode = SCALE_MODES[name][1]
    store = None
    if history_mode in ("per_step", "run_ahead"):  # the driver's own store, in the work dir
        from rl_driver.history_store import HistoryStore

        store = HistoryStore(Path(args.workdir) / f"history-{name}")
    engine = engine_factory(name)
    rows = []
    try:
        for i, step in enumerate(plan):
            k, row = step["step"], {"step": step["step"]}
            t0 = time.perf_counter()
            load_checkpoint(engine, checkpoints[k])
            row["load_s"] = time.perf_counter() - t0
            if store is not None:  # the step's prompts in, from the driver's store
                t0 = time.perf_counter()
                states = store.get(step["prompts"])
                row["import_bytes"] = sum(len(pickle.dumps(s, protocol=5)) for s in states)
                for state in states:
                    engine.rhyme_import_history(state, replace=True)
                row["import_s"] = time.perf_counter() - t0
            ahead = None
            if history_mode == "run_ahead" and i + 1 < len(plan):
                ahead = {"prompts": [by_id[p] for p in plan[i + 1]["prompts"]],
                         "samples": args.run_ahead_samples, "below": args.run_ahead_below,
                         "slots": args.run_ahead_slots, "seed": args.seed, "step": k,
                         "max_new_tokens": args.max_new_tokens}
            engine.rhyme_breakdown(reset=True)
            prompts = [by_id[p] for p in step["prompts"]]
            results, makespan, ahead_stats = engine.loop.run_until_complete(_step_requests(
                engine, prompts, args.group, args.max_new_tokens, _seeds(args, step, args.group),
                ahead))
            ref = answers[k]
            row.update(makespan_s=makespan, tau=_tau(results),
                       output_tokens=sum(len(r["ids"]) for r in results),
                       same_tokens_as_vanilla=sum(
                           list(r["ids"]) == ref[r["prompt"].prompt_id, r["sample"]]
                           for r in results) / len(results))
            if ahead is not None:
                row["run_ahead"] = ahead_stats
            if history_mode is not None:
                rewards = _rewards(results, tok)
                engine.rhyme_set_rewards([{"prompt_id": r["prompt"].prompt_id,
                                           "sample": r["sample"], "reward": x}
                                          for r, x in zip(results, rewards)])
                stats = engine.rhyme_stats()
                row["store_bytes"] = int(stats.get("memory_bytes") or 0)
                row["store_prompts"] = int(stats.get("num_prompts") or 0)
                row["run_ahead_records"] = int(stats.get("run_ahead_records") or 0)
                row["residue_tokens"] = int(stats.get("dropped_global_tokens") or 0)
            if store is not None:  # the step's prompts back out, and gone from the engine
                t0 = time.perf_counter()
                states = engine.rhyme_export_histories(step["prompts"])
                row["export_bytes"] = sum(len(pickle.dumps(x, protocol=5)) for x in states)
                row["store_write_bytes"] = store.put(states)
                engine.rhyme_drop_history(step["prompts"])
                row["export_s"] = time.perf_counter() - t0
            rows.append(row)
            logger.info("%s step %d (%s): %.1fs, tau %.2f%s", name, k, step["visit"], makespan,
                        row["tau"], f", run-ahead {ahead_stats}" if ahead is not None else "")
    finally:
        engine.shutdown()
    return rows


def _mean(rows, key, steps) -> Optional[float]:
    values = [r[key] for r in rows if r["step"] in steps and key in r]
    return statistics.mean(values) if values else None


def summarize(plan, per_mode: Dict[str, List[dict]], train_s: Sequence[float],
              sim: Optional[dict]) -> dict:
    """The ``dataset_scale`` block and the ``per_step`` rows from each mode's step rows."""
    revisit = {s["step"] for s in plan if s["visit"] == "revisit"}
    first = {s["step"] for s in plan if s["visit"] == "first" and s["step"] > 0}
    get = per_mode.get
    block = {
        "revisit_tau": {"in_engine": _mean(get("rhyme", []), "tau", revisit),
                        "per_step_load": _mean(get("rhyme_per_step", []), "tau", revisit)},
        "first_visit_tau": {"siblings_only": _mean(get("rhyme_per_step", []), "tau", first),
                            "run_ahead": _mean(get("rhyme_run_ahead", []), "tau", first)},
        "engine_store_bytes_max": {
            "in_engine": max((r.get("store_bytes", 0) for r in get("rhyme", [])), default=None),
            "per_step_load": max((r.get("store_bytes", 0) for r in get("rhyme_per_step", [])),
                                 default=None)},
    }
    # dropped prompts' tokens left in the engines' cross-prompt trie (bounded by the flag)
    block["residue_tokens_max"] = max(
        (r.get("residue_tokens", 0) for m in ("rhyme_per_step", "rhyme_run_ahead")
         for r in get(m, [])), default=None)
    # what a driver could not hide: export + import of a step beyond its train + weight load
    per_step = get("rhyme_per_step") or get("rhyme_run_ahead") or []
    critical, step_s = [], []
    for row in per_step:
        hidden = train_s[row["step"]] + row["load_s"]
        transfer = row.get("import_s", 0.0) + row.get("export_s", 0.0)
        critical.append(max(0.0, transfer - hidden))
        step_s.append(row["makespan_s"] + hidden)
    block["transfer_s_on_critical_path"] = statistics.mean(critical) if critical else None
    block["step_s_mean"] = statistics.mean(step_s) if step_s else None
    block["transfer_s_per_step"] = statistics.mean(
        r.get("import_s", 0.0) + r.get("export_s", 0.0) for r in per_step) if per_step else None
    block["first_visit_speedup_sim_h200"] = sim
    base = {r["step"]: r["makespan_s"] for r in get("vanilla", [])}
    block["speedup_vs_vanilla"] = {
        visit: {m: sum(base[r["step"]] for r in rows if r["step"] in steps)
                / max(1e-9, sum(r["makespan_s"] for r in rows if r["step"] in steps))
                for m, rows in per_mode.items() if m != "vanilla" and base}
        for visit, steps in (("revisit", revisit), ("first_visit", first))}
    rows = []
    for s in plan:
        row = {"step": s["step"], "epoch": s["epoch"], "visit": s["visit"],
               "updates_since_last_visit": s["updates_since"], "train_s": train_s[s["step"]]}
        for m, mode_rows in per_mode.items():
            row[m] = next((r for r in mode_rows if r["step"] == s["step"]), None)
        rows.append(row)
    return {"dataset_scale": block, "per_step": rows}


def by_pass(records, plan) -> list:
    """``records`` (epoch = step) relabelled with their pass over the dataset as the epoch."""
    epoch_of = {s["step"]: s["epoch"] for s in plan}
    return [dataclasses.replace(r, epoch=epoch_of[r.epoch]) for r in records]


def first_visit_sim(records, args) -> dict:
    """``benchmarks.first_visit_sim.first_visit_speedup`` on the trajectory's responses (epoch =
    pass over the dataset) with ``--sim-cost-table`` (the measured H200 table by default), its
    default engines and run-ahead derivation, ``--run-ahead-samples`` a prompt."""
    from benchmarks.first_visit_sim import first_visit_speedup
    from benchmarks.cost_tables import load_table

    out = first_visit_speedup(records, load_table(args.sim_cost_table),
                              run_ahead_samples=args.run_ahead_samples)
    out["assumptions"]["cost_table"] = Path(args.sim_cost_table).name
    return out


def run(args, model_path: str, dtype: str, prompts, tok, report: dict) -> dict:
    """The whole dataset-scale run (module docstring); fills ``report`` and returns it."""
    from rhyme_sglang import Engine

    if args.prompts_per_step >= len(prompts):
        raise ValueError(f"--prompts-per-step must be below --dataset-prompts "
                         f"({len(prompts)}), got {args.prompts_per_step}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(SCALE_MODES))
    if unknown or "vanilla" not in modes:
        raise ValueError(f"--modes must name vanilla and modes of {sorted(SCALE_MODES)}, got "
                         f"{args.modes!r}")
    by_id = {p.prompt_id: p for p in prompts}
    plan = step_plan(list(by_id), args.prompts_per_step, args.epochs, args.seed)
    report.update(plan=[{k: v for k, v in s.items() if k != "prompts"} for s in plan],
                  dataset_prompts=len(prompts), prompts_per_step=args.prompts_per_step,
                  run_ahead={"samples": args.run_ahead_samples, "below": args.run_ahead_below,
                             "slots": args.run_ahead_slots})

    def engine_factory(name):
        return Engine(model_path=model_path, dtype=dtype, log_level="error",
                      max_running_requests=args.max_running,
                      max_total_tokens=args.max_total_tokens, **SCALE_MODES[name][0])

    wall, began = report.setdefault("wall_s", {}), time.perf_counter()
    checkpoints, answers, records, train_s = trajectory(
        engine_factory, model_path, dtype, by_id, plan, tok, args, report)
    wall["trajectory"] = time.perf_counter() - began
    if "workload" in report:  # reuse etc. of the dataset's passes
        from benchmarks.trace_stats import epoch_stats

        report["workload"]["trace_stats"] = epoch_stats(by_pass(records, plan))
    write_json(args.json, report)
    per_mode: Dict[str, List[dict]] = {}
    for name in modes:
        t0 = time.perf_counter()
        per_mode[name] = run_mode(name, engine_factory, by_id, plan, checkpoints, answers, tok,
                                  args)
        wall[name] = time.perf_counter() - t0
        report["modes"] = per_mode
        write_json(args.json, report)  # partial results survive an interrupted run
    sim = first_visit_sim(by_pass(records, plan), args)
    report.update(summarize(plan, per_mode, train_s, sim))
    _write_trace(args.json, records, report)
    wall["total"] = time.perf_counter() - began
    return report


def _write_trace(json_path, records, report) -> None:
    from rhyme_sglang.core import write_trace

    if json_path:
        path = Path(json_path).with_suffix(".trajectory.trace.jsonl.gz")
        write_trace(str(path), records)
        report["trajectory"]["trace"] = path.name


def summary_line(report: dict) -> str:
    """One line for the terminal: the block's figures."""
    b = report["dataset_scale"]

    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    sim = b.get("first_visit_speedup_sim_h200") or {}
    return (f"dataset scale ({report['dataset_prompts']} prompts, {report['prompts_per_step']} "
            f"a step, {len(report['plan'])} steps): revisit tau in-engine "
            f"{f(b['revisit_tau']['in_engine'])} per-step load "
            f"{f(b['revisit_tau']['per_step_load'])}; first-visit tau siblings only "
            f"{f(b['first_visit_tau']['siblings_only'])} run-ahead "
            f"{f(b['first_visit_tau']['run_ahead'])}; store max in-engine "
            f"{f(b['engine_store_bytes_max']['in_engine'], '{:.0f}')} B per-step "
            f"{f(b['engine_store_bytes_max']['per_step_load'], '{:.0f}')} B; transfer on the "
            f"critical path {f(b['transfer_s_on_critical_path'], '{:.3f}')} s of "
            f"{f(b['step_s_mean'], '{:.1f}')} s a step; speedup vs vanilla "
            + ", ".join(f"{v} " + " ".join(f"{m} x{x:.2f}" for m, x in d.items())
                        for v, d in b["speedup_vs_vanilla"].items())
            + f"; H200 sim first visit rhyme x{f(sim.get('rhyme'))} run-ahead "
              f"x{f(sim.get('rhyme_run_ahead'))}")
