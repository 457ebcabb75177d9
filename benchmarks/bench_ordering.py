"""The ordering part of ``benchmarks.bench_rollout``: FCFS vs longest-predicted-first.

One RHYME engine with few running slots generates a mix of short and long prompts
(``--ordering-datasets``/``--ordering-prompts``) with both waiting-queue policies on identical
work (see :func:`run_ordering`); :mod:`benchmarks.ordering_sim` replays the same lengths under
this machine's step costs and a flat GPU-like one. Run it through bench_rollout (``--ordering-*``
flags, ``--ordering-only``).
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from benchmarks.rollout_requests import MODES, build_prompts, timed_pairs

logger = logging.getLogger("benchmarks.bench_rollout")


def _ordered_groups(prompts, group: int, seed: int, shuffle: bool):
    """(prompt, sample) pairs with prompt groups kept together: in dataset order (the datasets
    of a multi-task batch one after the other) or in a seeded random order."""
    import random

    order = list(prompts)
    if shuffle:
        random.Random(seed).shuffle(order)
    return [(p, s) for p in order for s in range(group)]


def _spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def run_ordering(model_path, dtype, prompts, args, checkpoint, workdir) -> dict:
    """FCFS vs longest-predicted-first (LPT) on one RHYME engine with few running slots.

    Two untimed epochs of the prompt mix are sampled first (temperature 1.0, same weights):
    epoch A is the history behind the length predictions (saved as a snapshot), epoch B gives
    each request's length for the timed runs. Every timed run restores snapshot A (identical
    history, drafting and predictions), flushes the prefix cache, sets the waiting-queue policy
    at run time and submits all requests at once; request (prompt, sample) generates exactly
    its epoch-B length (``ignore_eos``), so both policies do the same work with a real length
    distribution, predicted from the previous epoch as in RL. (Free-running sampling would
    not do: the few long samples' lengths vary from run to run by more than the ordering
    effect, and even greedy bf16 outputs change with batch composition.) Repeats alternate
    which policy runs first, so slow drift of the machine hits both alike."""
    from rhyme_sglang import Engine

    group, slots = args.ordering_group, args.ordering_max_running
    shuffle = args.ordering_order == "shuffled"
    snapshot = str(Path(workdir) / "ordering-history.snap")
    runs = {"fcfs": [], "lpt": []}
    engine = Engine(model_path=model_path, dtype=dtype, log_level="error",
                    max_running_requests=slots, **MODES["rhyme"])
    pairs0 = _ordered_groups(prompts, group, args.seed, shuffle)
    try:
        if checkpoint != model_path:
            engine.update_weights_from_disk(checkpoint)
        run = engine.loop.run_until_complete
        hist_a, _ = run(timed_pairs(engine, pairs0, args.ordering_max_new_tokens))
        engine.rhyme_advance_epoch()
        engine.rhyme_save(snapshot)
        hist_b, _ = run(timed_pairs(engine, pairs0, args.ordering_max_new_tokens))
        lengths = {(r["prompt"].prompt_id, r["sample"]): len(r["ids"]) for r in hist_b}
        engine.rhyme_load(snapshot)
        predicted = dict(zip((p.prompt_id for p in prompts),
                             engine.rhyme_predict_lengths([p.prompt_id for p in prompts])))
        orders = []
        for rep in range(args.ordering_repeats):
            pairs = _ordered_groups(prompts, group, args.seed + 1 + rep, shuffle)
            orders.append([(p.prompt_id, lengths[p.prompt_id, s]) for p, s in pairs])
            for policy in (("fcfs", "lpt") if rep % 2 == 0 else ("lpt", "fcfs")):
                engine.rhyme_load(snapshot)
                engine.flush_cache_blocking()
                engine.rhyme_schedule_policy(policy)
                before = engine.rhyme_stats()
                results, makespan = run(timed_pairs(engine, pairs, args.ordering_max_new_tokens,
                                                     lengths))
                after = engine.rhyme_stats()
                tokens = sum(len(r["ids"]) for r in results)
                runs[policy].append({
                    "makespan_s": makespan, "output_tokens": tokens,
                    # decode steps that verified drafts vs plain steps (the cost model's choice)
                    "decode_steps": {m: after["decode_steps"][m] - before["decode_steps"].get(m, 0)
                                     for m in after["decode_steps"]},
                    "accepted_draft_tokens": after["accepted_tokens"] - before["accepted_tokens"]})
                logger.info("ordering %s repeat %d: %.1f s, %d tokens", policy, rep, makespan, tokens)
        cost_model = engine.rhyme_stats()["cost_model"]
    finally:
        engine.shutdown()
    keys = sorted(lengths)
    out = {
        "max_running_requests": slots, "group": group, "requests": len(pairs0),
        "order": args.ordering_order, "max_new_tokens": args.ordering_max_new_tokens,
        "repeats": args.ordering_repeats,
        "response_length": {"mean": statistics.mean(lengths.values()),
                            "max": max(lengths.values()), "min": min(lengths.values())},
        "predicted_vs_actual_spearman": _spearman([predicted[k[0]] for k in keys],
                                                  [lengths[k] for k in keys]),
        "predicted_length": predicted,
        "runs": runs,
        "simulated": _simulate(orders, predicted, slots, cost_model),
    }
    for policy in ("fcfs", "lpt"):
        out[f"{policy}_makespan_s"] = statistics.mean(r["makespan_s"] for r in runs[policy])
    out["lpt_speedup"] = out["fcfs_makespan_s"] / out["lpt_makespan_s"]
    return out


def _simulate(orders, predicted, slots, cost_model) -> dict:
    """The same workloads replayed by :mod:`benchmarks.ordering_sim` under this machine's
    measured step-cost curve and under a flat curve (every step costs a full batch's step,
    the shape of a memory-bound GPU decode)."""
    from benchmarks import ordering_sim

    try:
        cpu = ordering_sim.step_curve(cost_model)
    except ValueError as exc:
        return {"skipped": str(exc)}
    out = {"step_seconds": {b: cpu(b) for b in (1, 2, 4, slots)}}
    for name, curve in (("measured_curve", cpu), ("flat_curve", lambda b: cpu(slots))):
        sims = [ordering_sim.compare(o, predicted, slots, curve) for o in orders]
        fcfs = statistics.mean(x["fcfs_s"] for x in sims)
        lpt = statistics.mean(x["lpt_s"] for x in sims)
        out[name] = {"fcfs_s": fcfs, "lpt_s": lpt, "lpt_speedup": fcfs / lpt}
    return out


def ordering_report(model_path, dtype, checkpoint, args) -> dict:
    """The ``ordering`` section of bench_rollout's report, from its ``--ordering-*`` args."""
    counts = [int(c) for c in args.ordering_prompts.split(",")]
    mix, _ = build_prompts(model_path, counts, args.ordering_datasets.split(","), args.seed + 1)
    return run_ordering(model_path, dtype, mix, args, checkpoint, args.workdir)
