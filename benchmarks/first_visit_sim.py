"""First-visit steps: RHYME without history, with and without run-ahead, under a cost table.

A prompt on its first visit of an RL run has no history: RHYME drafts from its in-flight
siblings only. Run-ahead (BubbleSpec / SRT) fills the engines' idle time at the end of a step
with responses to the NEXT step's prompts, sampled with the current weights; they join the
history as draft-only records (``ResponseRecord.run_ahead``, weighted
``StoreConfig.run_ahead_weight``), aborted when the step's last real request finishes.

Every simulated epoch ``e`` of the trace is one first-visit step, simulated by
``benchmarks.rollout_sim.run_mode`` with the epoch's records only (no earlier history, no length
statistics: every prediction is the epoch's mean length), in three runs:

- ``vanilla``: plain decoding;
- ``rhyme``: the DraftStore with no history (siblings in flight and finished siblings only);
- ``rhyme_run_ahead``: the same store after importing, for each prompt, ``run_ahead_samples``
  run-ahead records (lowest sample numbers first) and closing one epoch (they were generated
  during the step before). ``run_ahead_source``: ``"previous_epoch"`` takes them from epoch
  ``e - 1`` (a policy one update older: the weights before this step's update, which are
  what the engines hold while the previous step runs), from epoch ``e + 1`` when ``e`` is 0;
  ``"next_epoch"`` always from ``e + 1``; ``"same_epoch"`` from epoch ``e`` itself (the
  responses the step is about to generate: a ceiling, not a policy).

Each run-ahead response keeps ``floor(fraction * length)`` tokens; as in the engine, a cut
one (aborted) shorter than ``run_ahead_min_tokens`` (``StoreConfig``'s default) is not kept.
``run_ahead_fraction=None`` derives the fraction from the vanilla run of the same epoch (the
step before has the same shape): idle engine-seconds ``I = sum_e (makespan - busy_e -
prefill_e)``; the run-ahead batch per engine ``b = min(max_running, ceil(R / engines))`` for
``R = prompts * run_ahead_samples`` requests; plain decode throughput ``b / seconds(b, 0, c)``
tokens per second per engine at context ``c`` = mean prompt length + half the mean scaled
run-ahead length; ``fraction = min(1, I * throughput / (length_scale * sum of run-ahead
lengths))``. The run-ahead requests' prefill is not charged.

Records carry the store's real ``run_ahead`` flag when ``StoreConfig`` has
``run_ahead_weight``; otherwise they are ordinary records of the closed epoch, weighted by
the store's ``epoch_decay`` (``assumptions.run_ahead_records`` says which).

    python -m benchmarks.first_visit_sim TRACE [--cost-table PATH] [--engines 8]
        [--run-ahead-samples 2] [--run-ahead-fraction F] [--copies C] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

from rhyme_sglang.core import StoreConfig, read_trace
from rhyme_sglang.core.trace import TraceRecord

from .common import write_json
from .cost_tables import load_table
from .peers.rhyme import RhymeSource
from .rollout_sim import SimConfig, run_mode, scale_records

logger = logging.getLogger("benchmarks.first_visit_sim")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TABLE = os.path.join(DATA, "cost_h200_qwen2-7b.json")
SOURCES = ("previous_epoch", "next_epoch", "same_epoch")
REAL_FLAG = "run_ahead_weight" in {f.name for f in dataclasses.fields(StoreConfig)}


def _by_epoch(records: Sequence[TraceRecord]) -> Dict[int, List[TraceRecord]]:
    out: Dict[int, List[TraceRecord]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.epoch, r.prompt_id, r.sample)):
        out[r.epoch].append(r)
    return dict(out)


def source_epoch(epoch: int, epochs: Sequence[int], how: str) -> int:
    """The trace epoch whose responses stand for the run-ahead of ``epoch`` (see the module
    docstring); ValueError when the trace lacks it."""
    if how not in SOURCES:
        raise ValueError(f"run_ahead_source must be one of {SOURCES}, got {how!r}")
    want = epoch if how == "same_epoch" else epoch + 1 if how == "next_epoch" or epoch == 0 \
        else epoch - 1
    if want not in epochs:
        raise ValueError(f"run-ahead of epoch {epoch} ({how}) needs epoch {want}, "
                         f"which the trace lacks (epochs {sorted(epochs)})")
    return want


def run_ahead_responses(step: Sequence[TraceRecord], pool: Sequence[TraceRecord],
                        samples: int) -> Dict[str, List[TraceRecord]]:
    """Per prompt of ``step``: its first ``samples`` responses in ``pool`` by sample number."""
    mine: Dict[str, List[TraceRecord]] = defaultdict(list)
    for r in sorted(pool, key=lambda r: r.sample):
        mine[r.prompt_id].append(r)
    return {p: mine[p][:samples] for p in dict.fromkeys(r.prompt_id for r in step)}


def derive_fraction(vanilla_epoch: dict, run_ahead: Dict[str, List[TraceRecord]],
                    step: Sequence[TraceRecord], table, cfg: SimConfig) -> dict:
    """The run-ahead fraction the vanilla run's idle engine time allows (module docstring)."""
    makespan = vanilla_epoch["makespan_s"]
    idle = sum(max(0.0, makespan - b - p) for b, p in zip(vanilla_epoch["engine_busy_s"],
                                                          vanilla_epoch["engine_prefill_s"]))
    resp = [r for rs in run_ahead.values() for r in rs]
    out = {"idle_engine_s": idle, "run_ahead_requests": len(resp)}
    if not resp:
        return dict(out, fraction=0.0)
    batch = min(cfg.max_running, math.ceil(len(resp) / cfg.engines))
    needed = cfg.length_scale * sum(len(r.response_token_ids) for r in resp)
    context = statistics.fmean(len(r.prompt_token_ids) for r in step) + needed / len(resp) / 2
    per_engine = batch / table.seconds(batch, 0, context)
    budget = idle * per_engine
    return dict(out, batch_per_engine=batch, context_tokens=context,
                decode_tokens_per_s_per_engine=per_engine, budget_tokens=budget,
                needed_tokens=needed, fraction=min(1.0, budget / needed) if needed else 0.0)


def prepared_source(run_ahead: Dict[str, List[TraceRecord]], fraction: float, weight: float,
                    backend: str, min_tokens: Optional[int] = None) -> RhymeSource:
    """A RHYME source whose store holds the truncated run-ahead responses in a closed epoch."""
    cfg = StoreConfig(run_ahead_weight=weight) if REAL_FLAG else StoreConfig()
    if min_tokens is not None:
        cfg = dataclasses.replace(cfg, run_ahead_min_tokens=min_tokens)
    src = RhymeSource("rhyme", cfg, backend)
    for pid, rs in run_ahead.items():
        items = []
        for k, r in enumerate(rs):
            n = math.floor(fraction * len(r.response_token_ids))
            cut = n < len(r.response_token_ids)  # aborted: kept from run_ahead_min_tokens on
            if n >= (cfg.run_ahead_min_tokens if cut else 1):
                item = {"epoch": 0, "sample": k, "response": r.response_token_ids[:n],
                        "reward": None}
                if REAL_FLAG:
                    item["run_ahead"] = True
                items.append(item)
        if items:
            src.store.import_prompt({"format": 1, "prompt_id": pid,
                                     "prompt_tail": list(rs[0].prompt_token_ids),
                                     "epoch": 0, "records": items})
    src.store.advance_epoch()
    return src


def _tau(runs: Sequence[dict]) -> float:
    tokens = sum(r["tokens"] for r in runs)
    steps = sum(r["tokens"] / r["tau"] for r in runs)
    return tokens / steps if steps else 1.0


def first_visit_speedup(records: Sequence[TraceRecord], table, cfg: SimConfig = SimConfig(engines=8),
                        *, run_ahead_samples: int = 2, run_ahead_fraction: Optional[float] = None,
                        run_ahead_source: str = "previous_epoch", run_ahead_weight: float = 0.5,
                        run_ahead_min_tokens: Optional[int] = None,
                        epochs: Optional[Sequence[int]] = None, backend: str = "auto") -> dict:
    """Vanilla, RHYME and RHYME with run-ahead on first-visit steps (every epoch of
    ``records`` in ``epochs``, default all, simulated alone; seconds and tau summed over them).

    Returns ``{"vanilla_s", "rhyme_s", "rhyme_run_ahead_s", "rhyme", "rhyme_run_ahead",
    "tau": {"rhyme", "rhyme_run_ahead"}, "assumptions", "per_epoch"}``; ``rhyme`` and
    ``rhyme_run_ahead`` are speedups over vanilla."""
    if run_ahead_samples < 0:
        raise ValueError(f"run_ahead_samples must be >= 0, got {run_ahead_samples}")
    if run_ahead_fraction is not None and not 0.0 <= run_ahead_fraction <= 1.0:
        raise ValueError(f"run_ahead_fraction must be in [0, 1], got {run_ahead_fraction}")
    by_epoch = _by_epoch(records)
    chosen = sorted(by_epoch) if epochs is None else list(epochs)
    missing = [e for e in chosen if e not in by_epoch]
    if not chosen or missing:
        raise ValueError(f"epochs {missing or chosen} are not in the trace ({sorted(by_epoch)})")
    per_epoch, runs = {}, defaultdict(list)
    for e in chosen:
        step = by_epoch[e]
        src_epoch = source_epoch(e, list(by_epoch), run_ahead_source)
        ahead = run_ahead_responses(step, by_epoch[src_epoch], run_ahead_samples)
        vanilla = run_mode("vanilla", step, table, cfg, backend)["per_epoch"][str(e)]
        rhyme = run_mode("rhyme", step, table, cfg, backend)["per_epoch"][str(e)]
        derived = derive_fraction(vanilla, ahead, step, table, cfg)
        fraction = derived["fraction"] if run_ahead_fraction is None else run_ahead_fraction
        src = prepared_source(ahead, fraction, run_ahead_weight, backend, run_ahead_min_tokens)
        held = list(src.store.records())
        flagged = all(getattr(r, "run_ahead", False) for r in held)
        with_ahead = run_mode("rhyme", step, table, cfg, backend, source=src)["per_epoch"][str(e)]
        for name, run in (("vanilla", vanilla), ("rhyme", rhyme), ("rhyme_run_ahead", with_ahead)):
            runs[name].append(run)
        per_epoch[str(e)] = {
            "source_epoch": src_epoch, "fraction": fraction, "derived": derived,
            "run_ahead_records": len(held), "run_ahead_flagged": flagged,
            "run_ahead_record_tokens": sum(r.response_len for r in held),
            "vanilla_s": vanilla["makespan_s"], "rhyme_s": rhyme["makespan_s"],
            "rhyme_run_ahead_s": with_ahead["makespan_s"],
            "tau": {"rhyme": rhyme["tau"], "rhyme_run_ahead": with_ahead["tau"]}}
        logger.info("epoch %d: vanilla %.3f s, rhyme %.3f s, run-ahead %.3f s (fraction %.2f)", e,
                    vanilla["makespan_s"], rhyme["makespan_s"], with_ahead["makespan_s"], fraction)
    secs = {n: sum(r["makespan_s"] for r in rs) for n, rs in runs.items()}
    return {
        "vanilla_s": secs["vanilla"], "rhyme_s": secs["rhyme"],
        "rhyme_run_ahead_s": secs["rhyme_run_ahead"],
        "rhyme": secs["vanilla"] / secs["rhyme"],
        "rhyme_run_ahead": secs["vanilla"] / secs["rhyme_run_ahead"],
        "tau": {"rhyme": _tau(runs["rhyme"]), "rhyme_run_ahead": _tau(runs["rhyme_run_ahead"])},
        "assumptions": {
            "cost_table": f"{getattr(table, 'name', '?')} ({getattr(table, 'kind', '?')})",
            "config": dataclasses.asdict(cfg), "epochs": chosen,
            "first_visit": "each epoch simulated alone: no earlier history, length predictions "
                           "= the epoch's mean length",
            "run_ahead_source": run_ahead_source,
            "run_ahead_policy": "previous_epoch: the trace's responses one policy update older "
                                "stand for the current weights before this step's update "
                                "(epoch 0 uses epoch 1's)" if run_ahead_source == "previous_epoch"
                                else run_ahead_source,
            "run_ahead_samples": run_ahead_samples, "run_ahead_weight": run_ahead_weight,
            "run_ahead_min_tokens": src.store.config.run_ahead_min_tokens,
            "run_ahead_records": "ResponseRecord.run_ahead (StoreConfig.run_ahead_weight)"
                                 if all(v["run_ahead_flagged"] for v in per_epoch.values()) else "ordinary records of the closed epoch "
                                 "(weight epoch_decay; the store keeps no run_ahead flag)",
            "run_ahead_fraction": "given" if run_ahead_fraction is not None else
                                  "derived from the vanilla run's idle engine-seconds x plain "
                                  "decode throughput at the run-ahead batch (per epoch)",
            "fraction_per_epoch": {e: v["fraction"] for e, v in per_epoch.items()},
            "not_modelled": "run-ahead prefill; the engines' time spent on run-ahead is free "
                            "(idle otherwise)"},
        "per_epoch": per_epoch}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--cost-table", default=DEFAULT_TABLE)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--copies", type=int, default=1, help="repeat every prompt group this often")
    ap.add_argument("--length-scale", type=int, default=1, help="each trace step stands for N steps")
    ap.add_argument("--run-ahead-samples", type=int, default=2)
    ap.add_argument("--run-ahead-fraction", type=float, default=None, help="default: derived")
    ap.add_argument("--run-ahead-source", choices=SOURCES, default="previous_epoch")
    ap.add_argument("--run-ahead-weight", type=float, default=0.5)
    ap.add_argument("--run-ahead-min-tokens", type=int, default=None,
                    help="default: StoreConfig's (the engine's)")
    ap.add_argument("--epochs", default=None, help="comma-separated; default all")
    ap.add_argument("--backend", choices=("auto", "native", "python"), default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = SimConfig(k=args.k, max_running=args.max_running, engines=args.engines,
                    length_scale=args.length_scale)
    records = scale_records(read_trace(args.trace), args.copies)
    epochs = [int(e) for e in args.epochs.split(",")] if args.epochs else None
    out = first_visit_speedup(records, load_table(args.cost_table), cfg,
                              run_ahead_samples=args.run_ahead_samples,
                              run_ahead_fraction=args.run_ahead_fraction,
                              run_ahead_source=args.run_ahead_source,
                              run_ahead_weight=args.run_ahead_weight,
                              run_ahead_min_tokens=args.run_ahead_min_tokens, epochs=epochs,
                              backend=args.backend)
    out["assumptions"].update(trace=args.trace, copies=args.copies)
    fr = out["assumptions"]["fraction_per_epoch"]
    print(f"first_visit_sim {os.path.basename(args.trace)} x{args.copies} on {args.engines} engines: "
          f"vanilla {out['vanilla_s']:.3f} s, rhyme {out['rhyme_s']:.3f} s ({out['rhyme']:.2f}x, "
          f"tau {out['tau']['rhyme']:.2f}), rhyme+run-ahead {out['rhyme_run_ahead_s']:.3f} s "
          f"({out['rhyme_run_ahead']:.2f}x, tau {out['tau']['rhyme_run_ahead']:.2f}); run-ahead "
          f"fraction {min(fr.values()):.2f}-{max(fr.values()):.2f}")
    print(json.dumps(out, indent=1))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
