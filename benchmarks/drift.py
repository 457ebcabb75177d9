"""A ``bench_rollout`` report's makespans with each timed run's plain-step speed levelled.

On a shared 2-core machine a decode step's speed drifts 15-30% within minutes (two
RHYME rounds of one epoch, one after the other, ran their batch-1-2 plain steps at 65.8 and
49.2 ms), more than RHYME's prefill lead moves a makespan. Every mode of one report decodes
the same answers, so its plain steps at a given running batch do the same work in every run.
This module measures each run's speed as the pooled median plain-step time per batch size
(over every run of every mode in the report) summed over the run's own plain steps, divided
by what those steps took; the run's makespan times that factor is its makespan at the pooled
speed. Runs without plain steps (NGRAM, RHYME at a fixed width) are left out.

Bias, stated: a RHYME plain step's time includes its draft lookups and decision (about 1 ms a
step at batch 1-2 in the runs measured), so levelling also removes that cost from RHYME and the
levelled ratio is an upper estimate of RHYME's; read it beside the raw ratio, not instead.

    python -m benchmarks.drift out/rollout_*.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Dict, List

from benchmarks.common import epoch_total, write_json


def _plain_steps(breakdown: dict) -> List[tuple]:
    """(batch, seconds) of a run's recorded plain steps (its timeline may be strided)."""
    return [(int(bs), float(s)) for _, kind, bs, s, _ in breakdown.get("timeline", [])
            if kind == "plain"]


def speed_factors(report: dict) -> Dict[str, List[dict]]:
    """Per mode, one entry per timed run: epoch, round, makespan, the pooled-speed factor
    (> 1: the run's plain steps were faster than the pool's) and the levelled makespan."""
    runs = [(mode, b) for mode, bl in report.get("breakdown", {}).items() for b in bl]
    pool = defaultdict(list)
    for _, b in runs:
        for bs, s in _plain_steps(b):
            pool[bs].append(s)
    median = {bs: statistics.median(v) for bs, v in pool.items()}
    makespans = {(mode, r["epoch"], r["round"]): r["makespan_s"]
                 for mode, rows in report.get("per_epoch", {}).items() for r in rows}
    out: Dict[str, List[dict]] = {}
    for mode, b in runs:
        steps = _plain_steps(b)
        own = sum(s for _, s in steps)
        if not steps or own <= 0:
            continue
        factor = sum(median[bs] for bs, _ in steps) / own
        makespan = makespans[(mode, b["epoch"], b["round"])]
        out.setdefault(mode, []).append({
            "epoch": b["epoch"], "round": b["round"], "makespan_s": makespan,
            "factor": factor, "levelled_s": makespan * factor})
    return out


def summary(report: dict) -> dict:
    """Raw and levelled makespans per mode (sums over epochs of round means) and each one's
    ratio to vanilla's; needs vanilla's runs."""
    factors = speed_factors(report)
    if "vanilla" not in factors:
        raise ValueError("the report has no vanilla runs with plain steps to level against")
    totals = {mode: {key: epoch_total(rows, key) for key in ("makespan_s", "levelled_s")}
              for mode, rows in factors.items()}
    base = totals["vanilla"]
    return {mode: dict(t, raw_ratio=base["makespan_s"] / t["makespan_s"],
                       levelled_ratio=base["levelled_s"] / t["levelled_s"],
                       runs=factors[mode]) for mode, t in totals.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drift")
    parser.add_argument("reports", nargs="+", help="bench_rollout JSON reports")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out = {}
    for path in args.reports:
        with open(path) as f:
            out[path] = result = summary(json.load(f))
        print(path + ": " + ", ".join(
            f"{mode} x{v['raw_ratio']:.2f} raw, x{v['levelled_ratio']:.2f} levelled (factors "
            + "/".join(f"{r['factor']:.2f}" for r in v["runs"]) + ")"
            for mode, v in result.items()))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
