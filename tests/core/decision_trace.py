"""A seeded sequence of decode steps through :class:`SpecCostModel`, every decision recorded.

Run as a module to (re)write ``data/decision_trace.json``; ``test_decision_trace.py`` replays it
and compares each decision (same inputs, same decisions).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rhyme_sglang.core.cost_model import PLAIN, SpecCostModel
from rhyme_sglang.core.horizon import Horizon

TRACE = Path(__file__).parent / "data" / "decision_trace.json"
SEEDS = (0, 1, 2)
STEPS = 300


def _seconds(rng, bs, rows, keys):
    return (0.004 * (1 + 0.05 * (bs - 1)) + 0.0004 * rows + 1e-7 * keys) * rng.uniform(0.9, 1.3)


def _decide(m, bs, mode, gains, raw, per_request, horizon, contexts):
    """One decision: ``(width, counts, reason, advantage, promising, probe predicted)``."""
    if mode == "rows":
        d = m.decide(bs, gains=gains, horizon=horizon, contexts=contexts, raw=raw)
    else:
        expected = m.batch_expected(per_request)
        critical = None if horizon is None else m.critical_expected(per_request, horizon)
        raw_w = {w: sum(r.get(w, 0.0) for r in per_request) for w in m.widths}
        d = m.decide(bs, expected=expected, calibrated=True, horizon=horizon,
                     critical=critical, contexts=contexts, raw=raw_w)
    return d.width, d.counts, d.reason, d.advantage, d.promising, d.probe_predicted


def trace(seed: int, mode: str) -> list:
    rng = random.Random(seed)
    m = SpecCostModel(widths=(1, 2, 4, 8), probe_every=8, reexplore_every=16)
    out = []
    quality = 0.8
    for step in range(STEPS):
        if step % 50 == 0:
            quality = rng.choice([0.05, 0.4, 0.9])
        bs = rng.choice([1, 3, 4, 8, 13])
        contexts = [rng.randint(50, 3000) for _ in range(bs)] if rng.random() < 0.5 else None
        horizon = (Horizon(tuple(float(rng.randint(1, 400)) for _ in range(bs)),
                           float(rng.randint(0, 2000))) if rng.random() < 0.3 else None)
        raw = []
        for _ in range(bs):
            n = rng.randint(0, 8)
            p, probs = 1.0, []
            for _ in range(n):
                p *= rng.uniform(0.3, 1.0) * (0.5 + quality / 2)
                probs.append(round(p, 6))
            raw.append(probs)
        gains = []
        for probs in raw:
            s = sum(probs)
            gains.append([x * m.calibrated(s) / s for x in probs] if s > 0 else [])
        per_request = [{w: sum(probs[:w]) for w in m.widths} for probs in raw]
        if rng.random() < 0.1:  # a rested step
            m.probes.tick(bs)
            out.append(["rest"])
            continue
        width, counts, reason, advantage, promising, predicted = _decide(
            m, bs, mode, gains, raw, per_request, horizon, contexts)
        out.append([width, counts, reason, advantage, promising, predicted])
        if counts is None:
            counts = [min(width, len(r)) for r in raw] if width else [0] * bs
        accepted = 0
        if width != PLAIN:
            for probs, c in zip(raw, counts):
                if c:
                    a = sum(1 for x in probs[:c] if rng.random() < x * quality + 0.05)
                    accepted += a
                    m.observe_acceptance(sum(probs[:c]), a, level=sum(probs))
            if reason == "probe":
                m.probes.outcome(bs, accepted, predicted)
        rows = bs + sum(counts)
        lens = [c + 1 for c in counts] if contexts is not None else None
        m.observe_step(bs, width, _seconds(rng, bs, sum(counts), sum(contexts or [0])),
                       rows=rows if width else None, contexts=contexts,
                       lens=lens if width else None)
        if step == 150:
            m.forget_acceptance()
    return out


def all_traces() -> dict:
    return {f"{mode}-{seed}": trace(seed, mode) for mode in ("rows", "width") for seed in SEEDS}


if __name__ == "__main__":
    TRACE.write_text(json.dumps(all_traces()))
