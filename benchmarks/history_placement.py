"""Where should a prompt's history live when prompts move between engines? Memory and tau.

Offline, on a real multi-epoch trace (the replay protocol of ``docs/trace-format.md``, history
mode, k draft tokens): ``--engines`` draft stores stand for engines; each epoch every prompt is
served by one engine, and ``--move`` of the prompts move to another engine at every epoch
(a routing change, a restarted or added engine, the driver's re-balancing). Policies:

* ``stay``: a moved prompt starts with no history on its new engine (today without transfer);
* ``transfer``: on a move the new engine imports the prompt's history from the old one
  (``DraftStore.export_prompt`` / ``import_prompt``: ``GET``/``POST /rhyme/history``);
* ``replicate``: every finished response is added to every engine.

(Driver-side forwarding of each finished response to the next epoch's engine holds the same
data as ``transfer`` once the moves are known in advance; it is what the driver does for
migrated responses.) Prints one line per policy and the ratios, writes JSON.

    python -m benchmarks.history_placement --traces benchmarks/data/traces_smollm2_arith_dev.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

from rhyme_sglang.core import DraftStore, StoreConfig, accepted_length, read_trace

POLICIES = ("stay", "transfer", "replicate")


def _verify_steps(store: DraftStore, rec, k: int) -> int:
    rid = f"probe/{rec.prompt_id}/{rec.epoch}/{rec.sample}"
    store.start_request(rid, rec.prompt_token_ids, prompt_id=rec.prompt_id, sample=rec.sample)
    ref, pos, steps = rec.response_token_ids, 0, 0
    while pos < len(ref):
        a = accepted_length(store.speculate(rid, k), ref[pos:])
        store.add_tokens(rid, ref[pos:pos + a + 1])
        pos, steps = pos + a + 1, steps + 1
    store.finish_request(rid, add_to_history=False)
    return steps


def simulate(records, policy: str, engines: int, move: float, k: int, seed: int) -> dict:
    rng = random.Random(seed)
    by_epoch = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_epoch[r.epoch][r.prompt_id].append(r)
    prompts = sorted({r.prompt_id for r in records})
    home = {p: i % engines for i, p in enumerate(prompts)}
    stores = [DraftStore(StoreConfig()) for _ in range(engines)]
    tokens = steps = moved = 0
    for epoch in sorted(by_epoch):
        if epoch > 0:
            for p in prompts:
                if rng.random() < move:
                    old, home[p] = home[p], (home[p] + rng.randrange(1, engines)) % engines
                    moved += 1
                    if policy == "transfer":
                        try:
                            stores[home[p]].import_prompt(stores[old].export_prompt(p))
                        except ValueError:  # the old engine holds nothing for p
                            pass
            for p, recs in by_epoch[epoch].items():
                for rec in recs:
                    tokens += len(rec.response_token_ids)
                    steps += _verify_steps(stores[home[p]], rec, k)
        for p, recs in by_epoch[epoch].items():
            for rec in recs:
                targets = stores if policy == "replicate" else [stores[home[p]]]
                for s in targets:
                    s.add_response(p, rec.prompt_token_ids, rec.response_token_ids, epoch,
                                   rec.reward, rec.sample)
        for s in stores:
            s.advance_epoch()
    return {"policy": policy, "tau": tokens / steps if steps else 1.0, "moves": moved,
            "memory_bytes": sum(s.estimate_memory() for s in stores),
            "responses_held": sum(s.num_responses for s in stores)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.history_placement")
    parser.add_argument("--traces", default="benchmarks/data/traces_smollm2_arith_dev.jsonl.gz")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--move", type=float, default=0.25)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    records = read_trace(args.traces)
    rows = {p: simulate(records, p, args.engines, args.move, args.k, args.seed) for p in POLICIES}
    base = rows["stay"]
    for r in rows.values():
        r["tau_vs_stay"] = r["tau"] / base["tau"]
        r["memory_vs_stay"] = r["memory_bytes"] / base["memory_bytes"]
    print(f"history_placement ({args.engines} engines, {args.move:.0%} of prompts move per epoch, "
          f"k={args.k}): " + "; ".join(
              f"{p}: tau {r['tau']:.2f} (x{r['tau_vs_stay']:.2f}), memory "
              f"{r['memory_bytes'] / 2**20:.1f} MiB (x{r['memory_vs_stay']:.2f})"
              for p, r in rows.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "policies": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
