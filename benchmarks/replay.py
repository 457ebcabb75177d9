"""Replay benchmark: draft quality of every draft source on a multi-epoch rollout trace.

Implements the protocol of notes/trace-format.md: for each epoch e >= 1 and response R, a draft
source proposes at most k tokens given (prompt, R[:p]); a = longest accepted prefix (for trees: the
longest root path matching R[p:]); p += a + 1; tau = tokens / verify steps. All sources run in one
process on the same trace; results print as a table with the ratios rhyme/best-baseline and
rhyme/oracle, and optionally go to a JSON file.

Online mode caveat: the rhyme store and the oracle follow the protocol strictly (a response of
epoch e is visible to later siblings of its own prompt only). The global peers (sglang-ngram,
suffix) cannot restrict a global corpus per prompt, so they also see other prompts' finished
epoch-e responses: a small advantage to the baselines. SGLang's NGRAM is fed whole history
responses (prompt + response) but not the request's own tokens while it runs; Arctic's cache gets
the request's prompt and own tokens, as in vLLM.

Recency: `rhyme-d<X>` is RHYME with `epoch_decay` X (a record `a` epochs old weighs X**a; an
epoch of a trace whose `epoch` counts policy updates, as a dataset-scale run's steps do, is
one update).

Reward-weighting variants: `rhyme-online` (reward_rule="online": the coefficient is refitted
each epoch from the branches the epoch's responses took), `rhyme-sibling` (open-epoch siblings
weighted by their finished siblings' rewards), `rhyme-w<C>` (fixed coefficient C), and the
ceiling of any branch-ranking rule, `rhyme-rankoracle` (see peers/branches.py).
`--analyze-branches` adds the branch-point analysis of the rhyme store (peers/branches.py).

    python -m benchmarks.replay --traces PATH [--k 8] [--mode history|online] [--json OUT]
        [--analyze-branches]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import numpy as np

from rhyme_sglang.core import StoreConfig
from rhyme_sglang.core.draft import accepted_length
from rhyme_sglang.core.trace import TraceRecord, read_trace

from .peers import arctic, ngram
from .peers.base import DraftSource
from .peers.branches import BranchAnalysis, RankOracleSource, format_report
from .peers.histospec import HistoSpecSource
from .peers.oracle import OracleSource
from .peers.rhyme import RhymeSource

logger = logging.getLogger("benchmarks.replay")
ALL_SOURCES = ("rhyme", "rhyme-noreward", "rhyme-online", "rhyme-latest", "rhyme-chain",
               "histospec", "sglang-ngram", "sglang-ngram-tree", "suffix", "suffix-tree", "oracle",
               "oracle-ext", "rhyme-rankoracle")
VARIANTS = {"rhyme": {}, "rhyme-noreward": {"reward_weight": 0.0},
            "rhyme-online": {"reward_rule": "online"}, "rhyme-sibling": {"sibling_rewards": "finished"},
            "rhyme-online-sibling": {"reward_rule": "online", "sibling_rewards": "finished"},
            "rhyme-latest": {"history_epochs": 1}, "rhyme-chain": {"max_branch": 1}}
BASELINES = ("histospec", "sglang-ngram", "sglang-ngram-tree", "suffix", "suffix-tree")


def make_source(name: str, k: int, backend: str = "auto") -> DraftSource:
    """Build a source by name; raises RuntimeError with the reason when it is unavailable."""
    if name in VARIANTS:
        return RhymeSource(name, StoreConfig(**VARIANTS[name]), backend)
    for prefix, field in (("rhyme-w", "reward_weight"), ("rhyme-d", "epoch_decay")):
        if name.startswith(prefix):  # rhyme-w<C>: reward coefficient; rhyme-d<X>: recency decay
            try:
                value = float(name[len(prefix):])
            except ValueError:
                raise ValueError(f"bad {field} in source name {name!r}") from None
            return RhymeSource(name, StoreConfig(**{field: value}), backend)
    if name == "rhyme-rankoracle":
        return RankOracleSource(name)
    if name == "histospec":
        return HistoSpecSource()
    if name in ("oracle", "oracle-ext"):
        return OracleSource(k, extended=name == "oracle-ext")
    if name.startswith("sglang-ngram"):
        why = ngram.import_error()
        if why:
            raise RuntimeError(f"sglang NgramCorpus not importable ({why})")
        return ngram.NgramSource(k, tree=name.endswith("tree"))
    if name.startswith("suffix"):
        why = arctic.import_error()
        if why:
            raise RuntimeError(f"arctic-inference suffix decoding unavailable ({why})")
        return arctic.ArcticSource(tree=name.endswith("tree"))
    raise ValueError(f"unknown source {name!r}; choose from {ALL_SOURCES}")


def group_by_epoch(records: Sequence[TraceRecord]) -> Dict[int, List[TraceRecord]]:
    out: Dict[int, List[TraceRecord]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.epoch, r.prompt_id, r.sample)):
        out[r.epoch].append(r)
    return dict(out)


def replay_source(src: DraftSource, epochs: Dict[int, List[TraceRecord]], k: int, mode: str,
                  max_epoch: Optional[int] = None) -> dict:
    """Run one source over the trace; returns its tau, per-epoch tau, waste, lookup p50 and
    per-prompt [tokens, verify steps]."""
    online = mode == "online"
    per_epoch, lat = {}, []
    per_prompt: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    tokens = steps = proposed = accepted = 0
    last = max(epochs) if max_epoch is None else min(max_epoch, max(epochs))
    src.end_epoch(0, epochs.get(0, []), False)
    for e in range(1, last + 1):
        e_tokens = e_steps = 0
        for rec in epochs.get(e, []):
            ref = rec.response_token_ids
            src.start(rec)
            p, steps0 = 0, e_steps
            while p < len(ref):
                t0 = time.perf_counter()
                draft = src.propose(rec, ref[:p], k)
                lat.append(time.perf_counter() - t0)
                if len(draft) > k:
                    raise RuntimeError(f"{src.name} proposed {len(draft)} > k={k} tokens")
                a = accepted_length(draft, ref[p:])
                src.feedback(rec, len(draft), a)
                nxt = min(len(ref), p + a + 1)
                src.advance(rec, ref[p:nxt])
                proposed += len(draft)
                accepted += a
                p = nxt
                e_steps += 1
            src.finish(rec, online)
            e_tokens += len(ref)
            per_prompt[rec.prompt_id][0] += len(ref)
            per_prompt[rec.prompt_id][1] += e_steps - steps0
        src.end_epoch(e, epochs.get(e, []), online)
        per_epoch[str(e)] = e_tokens / e_steps if e_steps else 1.0
        tokens += e_tokens
        steps += e_steps
    return {"tau": tokens / steps if steps else 1.0, "per_epoch": per_epoch,
            "waste": proposed / accepted if accepted else None,
            "lookup_us_p50": 1e6 * statistics.median(lat) if lat else 0.0,
            "per_prompt": dict(per_prompt)}


def coefficient_ceiling(result: dict, records: Sequence[TraceRecord]) -> Optional[dict]:
    """Best fixed reward coefficient chosen per epoch in hindsight, over the `rhyme-w<C>` sources
    run (plus rhyme and rhyme-noreward): the tau no per-epoch coefficient rule can beat. In replay a
    store's state at an epoch does not depend on earlier coefficients (a new coefficient
    re-weights every group), so this mix of runs is one a switching rule could produce."""
    coefs = {n: float(n[len("rhyme-w"):]) for n in result["sources"] if n.startswith("rhyme-w")}
    for name in ("rhyme", "rhyme-noreward"):
        if name in result["sources"]:
            coefs[name] = StoreConfig(**VARIANTS[name]).reward_weight
    if len(coefs) < 2:
        return None
    tokens: Dict[str, int] = defaultdict(int)
    for r in records:
        tokens[str(r.epoch)] += len(r.response_token_ids)
    per_epoch, total_tokens, total_steps = {}, 0, 0.0
    for e in result["sources"][next(iter(coefs))]["per_epoch"]:
        best = max(coefs, key=lambda n: result["sources"][n]["per_epoch"][e])
        per_epoch[e] = coefs[best]
        total_tokens += tokens[e]
        total_steps += tokens[e] / result["sources"][best]["per_epoch"][e]
    return {"tau": total_tokens / total_steps, "coef_per_epoch": per_epoch}


def paired_spread(result: dict, a: str, b: str, resamples: int = 2000, seed: int = 0) -> float:
    """Standard deviation of tau(a) - tau(b) over bootstrap resamples of the trace's prompts
    (seeded): how much of a difference between two sources the choice of prompts explains."""
    pa, pb = result["sources"][a]["per_prompt"], result["sources"][b]["per_prompt"]
    keys = sorted(pa)
    tok = np.array([pa[key][0] for key in keys], dtype=float)
    sa = np.array([pa[key][1] for key in keys], dtype=float)
    sb = np.array([pb[key][1] for key in keys], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(resamples, len(keys)))
    diffs = tok[idx].sum(1) / sa[idx].sum(1) - tok[idx].sum(1) / sb[idx].sum(1)
    return float(diffs.std())


def run(records: Sequence[TraceRecord], k: int, mode: str, sources: Sequence[str],
        max_epoch: Optional[int] = None, backend: str = "auto") -> dict:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if mode not in ("history", "online"):
        raise ValueError(f"mode must be 'history' or 'online', got {mode!r}")
    epochs = group_by_epoch(records)
    result = {"k": k, "mode": mode, "sources": {}, "skipped": {}}
    warm = {e: recs[:8] for e, recs in epochs.items() if e <= 1}
    for name in sources:
        try:
            src = make_source(name, k, backend)
        except RuntimeError as exc:
            result["skipped"][name] = str(exc)
            logger.warning("skipping %s: %s", name, exc)
            continue
        replay_source(make_source(name, k, backend), warm, k, mode, 1)  # warm-up, discarded
        t0 = time.perf_counter()
        result["sources"][name] = replay_source(src, epochs, k, mode, max_epoch)
        logger.info("%s done in %.1f s", name, time.perf_counter() - t0)
    return result


def analyze_branches(records: Sequence[TraceRecord], k: int, mode: str,
                     max_epoch: Optional[int] = None, oracle_tau: Optional[float] = None) -> dict:
    """Branch-point analysis of the rhyme store (default config) plus the rank-oracle ceiling
    (replayed here unless its tau is given)."""
    epochs = group_by_epoch(records)
    analysis = BranchAnalysis()
    tau = replay_source(analysis, epochs, k, mode, max_epoch)["tau"]
    if oracle_tau is None:
        oracle_tau = replay_source(RankOracleSource(), epochs, k, mode, max_epoch)["tau"]
    return analysis.report(tau, oracle_tau)


def ratios(result: dict, target: float = 1.2) -> Dict[str, Optional[float]]:
    """rhyme against the best baseline and the ceilings; `target_tau` is `target` times the best
    baseline's tau, and `target/<ceiling>` says how much of each ceiling that would take."""
    src = result["sources"]
    out: Dict[str, Optional[float]] = {"best_baseline": None, "rhyme/best_baseline": None,
                                       "rhyme/oracle": None}
    base = [(src[n]["tau"], n) for n in BASELINES if n in src]
    if base:
        out["best_baseline"] = max(base)[1]
        out["target_tau"] = target * max(base)[0]
    if "rhyme" in src and base:
        out["rhyme/best_baseline"] = src["rhyme"]["tau"] / max(base)[0]
    for ceiling in ("oracle", "oracle-ext"):
        if ceiling in src:
            if "rhyme" in src:
                out[f"rhyme/{ceiling}"] = src["rhyme"]["tau"] / src[ceiling]["tau"]
            if base:
                out[f"target/{ceiling}"] = out["target_tau"] / src[ceiling]["tau"]
    return out


def format_table(result: dict) -> str:
    srcs = result["sources"]
    epochs = sorted({e for s in srcs.values() for e in s["per_epoch"]}, key=int)
    head = f"{'source':<18} {'tau':>6} " + " ".join(f"{'e' + e:>5}" for e in epochs) \
        + f" {'waste':>6} {'lookup_us':>9}"
    lines = [f"replay k={result['k']} mode={result['mode']}", head, "-" * len(head)]
    for name, s in srcs.items():
        waste = f"{s['waste']:.2f}" if s["waste"] is not None else "-"
        lines.append(f"{name:<18} {s['tau']:>6.3f} "
                     + " ".join(f"{s['per_epoch'][e]:>5.2f}" for e in epochs)
                     + f" {waste:>6} {s['lookup_us_p50']:>9.1f}")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"{name:<18} skipped: {why}")
    if "rhyme-noreward" in srcs:
        for name in (n for n in srcs if n.startswith("rhyme") and n != "rhyme-noreward"):
            diff = srcs[name]["tau"] - srcs["rhyme-noreward"]["tau"]
            lines.append(f"{name} - rhyme-noreward: {diff:+.3f} (prompt-bootstrap sd "
                         f"{paired_spread(result, name, 'rhyme-noreward'):.3f})")
    r = ratios(result)
    if r["rhyme/best_baseline"] is not None:
        lines.append(f"rhyme / best baseline ({r['best_baseline']}): {r['rhyme/best_baseline']:.3f}")
    for ceiling in ("oracle", "oracle-ext"):
        if r.get(f"rhyme/{ceiling}") is not None:
            lines.append(f"rhyme / {ceiling}: {r[f'rhyme/{ceiling}']:.3f}")
    if r.get("target_tau") is not None:
        shares = ", ".join(f"{r[f'target/{c}']:.2f} of {c}" for c in ("oracle", "oracle-ext")
                           if f"target/{c}" in r)
        lines.append(f"1.2x the best baseline = tau {r['target_tau']:.3f}"
                     + (f" ({shares})" if shares else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True, help="trace file (.jsonl or .jsonl.gz)")
    ap.add_argument("--k", type=int, default=8, help="max draft tokens per verify step")
    ap.add_argument("--mode", choices=("history", "online"), default="history")
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--sources", default=",".join(ALL_SOURCES), help="comma-separated list")
    ap.add_argument("--max-epoch", type=int, default=None, help="replay epochs 1..N only")
    ap.add_argument("--backend", choices=("auto", "native", "python"), default="auto")
    ap.add_argument("--analyze-branches", action="store_true",
                    help="also report branch points and the rank-oracle ceiling")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    records = read_trace(args.traces)
    result = run(records, args.k, args.mode, sources, args.max_epoch, args.backend)
    result["ratios"] = ratios(result)
    ceiling = coefficient_ceiling(result, records)
    if ceiling is not None:
        result["coefficient_ceiling"] = ceiling
    print(format_table(result))
    if ceiling is not None:
        print(f"best reward coefficient per epoch in hindsight: tau {ceiling['tau']:.3f} "
              f"(coefficients {ceiling['coef_per_epoch']})")
    if args.analyze_branches:
        known = result["sources"].get("rhyme-rankoracle", {}).get("tau")
        result["branches"] = analyze_branches(records, args.k, args.mode, args.max_epoch, known)
        print(format_report(result["branches"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
