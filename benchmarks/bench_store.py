"""Speed of the draft store: insert throughput and speculate latency, native vs pure Python.

Synthetic rollouts: each prompt has a base response (Zipf-distributed tokens); its G samples copy
the base with edits (a run of 1-5 tokens replaced at a per-token rate), like sibling samples
that mostly agree. Seeded; a warm-up pass runs first; one summary line per backend plus JSON.

In-flight part (native): `--inflight` responses grow in their prompt's live trie a few tokens
per step (`--step`, about one verify step's accepted tokens), round robin, as the scheduler
feeds them; growing each as a stream (what the store does) against growing it by plain
extension, side by side: the same logical trie, its records, bytes per in-flight
token and growth throughput.

Bytes per token (``store_footprint``): after the synthetic rollouts are inserted and their epoch
closed (so they sit in the global trie too), ``DraftStore.estimate_memory()`` and
``history_bytes()`` divided by the stored response tokens, per backend.

    python -m benchmarks.bench_store [--responses 10000] [--length 500] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import time
from array import array
from typing import List, Optional, Sequence

import numpy as np

from rhyme_sglang.core import DraftStore, StoreConfig
from rhyme_sglang.core.native import make_trie, native_available

logger = logging.getLogger("benchmarks.bench_store")


def make_rollouts(num_responses: int, length: int, group: int, edit_rate: float, seed: int):
    """[(prompt_id, prompt_ids, response_ids)] with `group` samples per prompt."""
    rng = np.random.default_rng(seed)
    vocab = 32000
    out = []
    for p in range((num_responses + group - 1) // group):
        base = (rng.zipf(1.3, size=length) % vocab).astype(np.int32)
        prompt = (rng.zipf(1.3, size=64) % vocab).astype(np.int32)
        for _ in range(group):
            if len(out) == num_responses:
                break
            resp = base.copy()
            for pos in np.flatnonzero(rng.random(length) < edit_rate):
                run = int(rng.integers(1, 6))
                resp[pos:pos + run] = rng.integers(0, vocab, size=len(resp[pos:pos + run]))
            out.append((f"p{p}", prompt.tolist(), resp.tolist()))
    return out


def store_footprint(store: DraftStore, response_tokens: int) -> dict:
    """Bytes per stored response token of a store: its whole estimate and its history's."""
    total, history = store.estimate_memory(), store.history_bytes()
    return {"response_tokens": response_tokens, "estimate_memory_bytes": total,
            "history_bytes": history, "bytes_per_token": total / response_tokens,
            "history_bytes_per_token": history / response_tokens}


def filled_store(rollouts, backend: str) -> DraftStore:
    """A store holding ``rollouts`` as epoch-0 history, the epoch closed."""
    store = DraftStore(StoreConfig(), backend=backend)
    for pid, prompt, resp in rollouts:
        store.add_response(pid, prompt, resp, 0)
    store.advance_epoch()
    return store


def bench_backend(backend: str, rollouts, num_queries: int, seed: int) -> dict:
    store = DraftStore(StoreConfig(), backend=backend)
    warm = DraftStore(StoreConfig(), backend=backend)
    for pid, prompt, resp in rollouts[:50]:
        warm.add_response(pid, prompt, resp, 0)
    tokens = sum(len(r) for _, _, r in rollouts)
    t0 = time.perf_counter()
    for pid, prompt, resp in rollouts:
        store.add_response(pid, prompt, resp, 0)
    insert_s = time.perf_counter() - t0
    store.advance_epoch()
    footprint = store_footprint(store, tokens)
    rng = np.random.default_rng(seed + 1)
    lat: List[float] = []
    for q in range(num_queries):
        pid, prompt, resp = rollouts[int(rng.integers(len(rollouts)))]
        rid = f"q{q}"
        store.start_request(rid, prompt, pid)
        cut = int(rng.integers(1, len(resp)))
        store.add_tokens(rid, resp[:cut])
        for _ in range(5):
            t1 = time.perf_counter()
            store.speculate(rid, 8)
            lat.append(time.perf_counter() - t1)
            store.add_tokens(rid, resp[cut:cut + 2])
            cut += 2
        store.finish_request(rid, add_to_history=False)
    tries = [store._global] + [p.tree for p in store._prompts.values()]
    return {"backend": backend, "responses": len(rollouts), "tokens": tokens,
            "insert_tokens_per_s": tokens / insert_s, "insert_s": insert_s,
            "speculate_us_p50": 1e6 * statistics.median(lat),
            "speculate_us_p90": 1e6 * sorted(lat)[int(0.9 * len(lat))],
            "trie_nodes": sum(t.num_nodes for t in tries),
            # node records actually allocated (native: the path-compressed count; Python: all)
            "trie_records": sum(getattr(t, "num_explicit", t.num_nodes) for t in tries),
            "estimate_memory_mb": store.estimate_memory() / 2 ** 20,
            "bytes_per_token": footprint["bytes_per_token"],
            "history_bytes_per_token": footprint["history_bytes_per_token"]}


def bench_inflight(rollouts, step: int, streams: bool, depth: int) -> dict:
    """Grow every response of `rollouts` in its prompt's live trie, `step` tokens at a time."""
    tries = {pid: make_trie(depth, "native") for pid, _, _ in rollouts}
    seqs = [array("i") for _ in rollouts]
    handles = [-1] * len(rollouts)
    length = max(len(r) for _, _, r in rollouts)
    t0 = time.perf_counter()
    for lo in range(0, length, step):
        for k, (pid, _, resp) in enumerate(rollouts):
            if lo < len(resp):
                seqs[k].extend(resp[lo:lo + step])
                trie = tries[pid]
                if lo == 0:
                    if streams:
                        handles[k] = trie.open_stream(seqs[k], 256)
                    else:
                        trie.insert(seqs[k], 256)
                else:
                    trie.extend(seqs[k], lo, 256, handles[k])
    grow_s = time.perf_counter() - t0
    tokens = sum(len(s) for s in seqs)
    mem = sum(t.estimate_memory() for t in tries.values())
    return {"streams": streams, "requests": len(rollouts), "tokens": tokens, "step": step,
            "grow_tokens_per_s": tokens / grow_s,
            "trie_nodes": sum(t.num_nodes for t in tries.values()),
            "trie_records": sum(t.num_explicit for t in tries.values()),
            "bytes_per_token": mem / tokens, "estimate_memory_mb": mem / 2 ** 20}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--responses", type=int, default=10000)
    ap.add_argument("--length", type=int, default=500)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--edit-rate", type=float, default=0.01)
    ap.add_argument("--python-responses", type=int, default=200,
                    help="the pure-Python twin is measured on this many responses only")
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inflight", type=int, default=512, help="in-flight responses (0 = skip)")
    ap.add_argument("--inflight-length", type=int, default=2000)
    ap.add_argument("--step", type=int, default=4, help="tokens added per request per step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rollouts = make_rollouts(args.responses, args.length, args.group, args.edit_rate, args.seed)
    results = []
    if native_available():
        results.append(bench_backend("native", rollouts, args.queries, args.seed))
    else:
        logger.warning("native module not built: measuring the pure-Python twin only")
    results.append(bench_backend("python", rollouts[:args.python_responses], args.queries // 4,
                                 args.seed))
    for r in results:
        print(f"{r['backend']:>6}: {r['responses']} responses x {args.length} tokens, insert "
              f"{r['insert_tokens_per_s'] / 1e6:.3f} M tok/s, speculate p50 {r['speculate_us_p50']:.1f} us "
              f"(p90 {r['speculate_us_p90']:.1f}), {r['trie_nodes'] / 1e6:.1f} M logical nodes in "
              f"{r['trie_records'] / 1e6:.1f} M records, "
              f"~{r['estimate_memory_mb']:.0f} MiB, {r['bytes_per_token']:.0f} B per stored token "
              f"(history {r['history_bytes_per_token']:.0f})")
    if len(results) == 2:
        print(f"native/python: insert x{results[0]['insert_tokens_per_s'] / results[1]['insert_tokens_per_s']:.1f}, "
              f"speculate x{results[1]['speculate_us_p50'] / results[0]['speculate_us_p50']:.1f} faster")
    inflight = []
    if args.inflight and native_available():
        grown = make_rollouts(args.inflight, args.inflight_length, args.group, args.edit_rate,
                              args.seed + 2)
        depth = StoreConfig().max_depth
        inflight = [bench_inflight(grown, args.step, False, depth),
                    bench_inflight(grown, args.step, True, depth)]
        if inflight[0]["trie_nodes"] != inflight[1]["trie_nodes"]:
            raise RuntimeError("streamed and plain growth gave different tries")
        for r in inflight:
            print(f"in-flight {'stream' if r['streams'] else 'plain ':>6}: {r['requests']} responses x "
                  f"{args.inflight_length} tokens, +{r['step']} per step: grow "
                  f"{r['grow_tokens_per_s'] / 1e6:.2f} M tok/s, {r['trie_records'] / 1e6:.2f} M records, "
                  f"{r['bytes_per_token']:.0f} B per in-flight token (~{r['estimate_memory_mb']:.0f} MiB)")
        print(f"stream/plain: memory x{inflight[0]['bytes_per_token'] / inflight[1]['bytes_per_token']:.1f} "
              f"smaller, growth x{inflight[1]['grow_tokens_per_s'] / inflight[0]['grow_tokens_per_s']:.1f} faster")
    out = {"config": vars(args), "results": results, "inflight": inflight,
           "bytes_per_token": {r["backend"]: r["bytes_per_token"] for r in results},
           "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
