"""History memory and transfer per step of a DAPO-17k-shaped run: in-engine vs per-step loading.

Shape (``Shape``): ``prompts`` in the dataset (17,000), ``batch`` prompts per step (512),
``samples`` responses per prompt (16), responses of ``length`` tokens (rows for 4K and 8K), after
``epochs_seen`` passes over the dataset (visits per prompt, a parameter). A history window ``w``
counts visits of the prompt (1 = its latest visit's responses, None = every visit): a prompt's
history is ``H = samples * length * min(w, epochs_seen)`` tokens.

- In-engine: every engine that served a prompt keeps its history. With uniform random placement
  over ``E`` engines a prompt has been served by ``E * (1 - (1 - 1/E) ** epochs_seen)`` engines
  (its copies); with affinity (always the same engine) by one. Memory per engine =
  ``prompts * H * bytes_per_token * copies / E``. No transfer with affinity; with random
  placement the history follows the prompt, at most per-step loading's import.
- Per-step loading: the driver holds the history; engines hold the current and the next step's
  prompts (``2 * batch / E`` histories) plus the step's new responses. Per step the driver
  imports the next step's histories (``batch * H`` tokens) and exports the step's new
  responses (``batch * samples * length`` tokens). Seconds per step on the critical path when
  not overlapped: the driver serializes every byte (one process, this machine's measured
  pickle + copy + unpickle throughput of real exported prompt states), sends it over one link
  (``link_bytes_per_s``, an assumption), and each engine runs ``export_prompt`` /
  ``import_prompt`` on its ``1/E`` share at the measured store rates. Its share of a step is
  against ``step_time_s``, an assumed parameter (not measured here).

Measured inline (``measure``): a native ``DraftStore`` filled with a real trace's responses
(``--trace``, default the long-overlap trace; ``--synthetic``: ``bench_store``'s synthetic
rollouts), epoch closed; bytes per stored response token (``bench_store.store_footprint``), the
exported states' pickled bytes per token, and the rates above. ``--bytes-per-token`` replaces
the measured footprint.

    python -m benchmarks.dapo_projection [--engines 8,64] [--link-gbps 10,1.25]
        [--step-time-s 600] [--epochs-seen 10] [--bytes-per-token B] [--json OUT]
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from .bench_store import filled_store, make_rollouts, store_footprint
from .common import write_json

logger = logging.getLogger("benchmarks.dapo_projection")
GIB = 2 ** 30
DEFAULT_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                             "traces_smollm2_long_overlap.jsonl.gz")


@dataclass(frozen=True)
class Shape:
    prompts: int = 17000
    batch: int = 512
    samples: int = 16
    length: int = 4096
    epochs_seen: int = 10

    def __post_init__(self) -> None:
        if min(self.prompts, self.batch, self.samples, self.length, self.epochs_seen) < 1:
            raise ValueError(f"every shape figure must be >= 1: {self}")

    def history_tokens(self, window: Optional[int]) -> int:
        """Tokens of one prompt's history under a window of ``window`` visits (None = all)."""
        visits = self.epochs_seen if window is None else min(window, self.epochs_seen)
        return self.samples * self.length * visits


def trace_rollouts(path: str) -> List[tuple]:
    """A trace's responses as ``bench_store`` rollouts ``(prompt_id, prompt_ids, response_ids)``."""
    from rhyme_sglang.core import read_trace

    return [(r.prompt_id, list(r.prompt_token_ids), list(r.response_token_ids))
            for r in read_trace(path)]


def measure(rollouts: Sequence[tuple], backend: str = "native", repeats: int = 5) -> dict:
    """Footprint of ``rollouts`` in a store (epoch closed) and the rates of moving its exported
    prompt states: ``export_prompt``, pickle + copy + unpickle, ``import_prompt`` into an empty
    store; each rate the best of ``repeats`` runs (the machine is shared)."""
    from rhyme_sglang.core import DraftStore, StoreConfig

    tokens = sum(len(r) for _, _, r in rollouts)
    store = filled_store(rollouts, backend)
    out = store_footprint(store, tokens)
    pids = list(dict.fromkeys(pid for pid, _, _ in rollouts))
    best = {"export": float("inf"), "serialize": float("inf"), "import": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        states = [store.export_prompt(pid) for pid in pids]
        t1 = time.perf_counter()
        blobs = [pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL) for s in states]
        copies = [bytes(bytearray(b)) for b in blobs]  # the copy a transport makes
        loaded = [pickle.loads(b) for b in copies]
        t2 = time.perf_counter()
        fresh = DraftStore(StoreConfig(), backend=backend)
        added = sum(fresh.import_prompt(s) for s in loaded)
        t3 = time.perf_counter()
        if added != len(rollouts):
            raise RuntimeError(f"imported {added} of {len(rollouts)} responses")
        for key, secs in (("export", t1 - t0), ("serialize", t2 - t1), ("import", t3 - t2)):
            best[key] = min(best[key], secs)
    wire = sum(len(b) for b in blobs)
    out.update(backend=store.backend, prompts=len(pids), responses=len(rollouts),
               serialized_bytes=wire, serialized_bytes_per_token=wire / tokens,
               export_tokens_per_s=tokens / best["export"],
               serialize_bytes_per_s=wire / best["serialize"],
               serialize_tokens_per_s=tokens / best["serialize"],
               import_tokens_per_s=tokens / best["import"], repeats=repeats)
    return out


def in_engine(shape: Shape, window: Optional[int], engines: int, bytes_per_token: float) -> dict:
    """Memory of keeping every prompt's history in the engines that served it."""
    copies = engines * (1 - (1 - 1 / engines) ** shape.epochs_seen)
    total = shape.prompts * shape.history_tokens(window) * bytes_per_token
    return {"copies_random": copies, "per_engine_gib_random": total * copies / engines / GIB,
            "per_engine_gib_affinity": total / engines / GIB, "cluster_gib_random": total * copies / GIB}


def per_step(shape: Shape, window: Optional[int], engines: int, bytes_per_token: float,
             meas: dict, link_bytes_per_s: float, step_time_s: float) -> dict:
    """Memory and transfer of loading each step's histories from the driver."""
    history = shape.history_tokens(window)
    new = shape.samples * shape.length
    per_engine_prompts = shape.batch / engines
    wire = meas["serialized_bytes_per_token"]
    import_tokens, export_tokens = shape.batch * history, shape.batch * new
    moved = (import_tokens + export_tokens) * wire
    serialize_s = moved / meas["serialize_bytes_per_s"]
    link_s = moved / link_bytes_per_s
    store_s = (import_tokens / meas["import_tokens_per_s"]
               + export_tokens / meas["export_tokens_per_s"]) / engines
    critical = serialize_s + link_s + store_s
    return {"per_engine_gib": per_engine_prompts * (2 * history + new) * bytes_per_token / GIB,
            "import_tokens": import_tokens, "export_tokens": export_tokens,
            "bytes_per_step": moved, "serialize_s": serialize_s, "link_s": link_s,
            "store_s": store_s, "critical_s": critical, "share_of_step": critical / step_time_s}


def project(meas: dict, bytes_per_token: float, lengths: Sequence[int], engines: Sequence[int],
            windows: Sequence[Optional[int]], links_gbps: Sequence[float], step_time_s: float,
            base: Shape = Shape()) -> List[dict]:
    """One row per (length, engines, window, link)."""
    rows = []
    for length in lengths:
        shape = Shape(base.prompts, base.batch, base.samples, length, base.epochs_seen)
        for e in engines:
            for w in windows:
                mem = in_engine(shape, w, e, bytes_per_token)
                for gbps in links_gbps:
                    rows.append({"length": length, "engines": e, "window": w, "link_gbps": gbps,
                                 "history_tokens_per_prompt": shape.history_tokens(w),
                                 "in_engine": mem,
                                 "per_step": per_step(shape, w, e, bytes_per_token, meas,
                                                      gbps * 1e9, step_time_s)})
    return rows


def format_table(rows: Sequence[dict]) -> str:
    head = (f"{'len':>5} {'E':>3} {'win':>4} {'in-engine GiB/eng rand|aff':>27} "
            f"{'per-step GiB/eng':>16} {'GB/step':>8} {'GB/s':>5} {'ser s':>6} {'link s':>7} "
            f"{'store s':>7} {'crit s':>7} {'share':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        m, p = r["in_engine"], r["per_step"]
        win = "all" if r["window"] is None else str(r["window"])
        lines.append(f"{r['length']:>5} {r['engines']:>3} {win:>4} "
                     f"{m['per_engine_gib_random']:>13.1f} | {m['per_engine_gib_affinity']:>11.1f} "
                     f"{p['per_engine_gib']:>16.2f} {p['bytes_per_step'] / 1e9:>8.2f} "
                     f"{r['link_gbps']:>5.2f} {p['serialize_s']:>6.2f} {p['link_s']:>7.2f} "
                     f"{p['store_s']:>7.2f} {p['critical_s']:>7.2f} {p['share_of_step']:>6.1%}")
    return "\n".join(lines)


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=17000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--engines", default="8,64")
    ap.add_argument("--epochs-seen", type=int, default=10,
                    help="visits per prompt so far (assumed; the window 'all' rows grow with it)")
    ap.add_argument("--link-gbps", default="10,1.25", help="link bandwidths, GB/s (assumed)")
    ap.add_argument("--step-time-s", type=float, default=600.0,
                    help="one RL step's seconds (assumed, not measured)")
    ap.add_argument("--bytes-per-token", type=float, default=None,
                    help="default: measured here (bench_store.store_footprint)")
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help="the responses measured (real exported prompt states)")
    ap.add_argument("--synthetic", action="store_true",
                    help="measure bench_store's synthetic rollouts instead of --trace")
    ap.add_argument("--synthetic-length", type=int, default=1024)
    ap.add_argument("--backend", choices=("native", "python"), default="native")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base = Shape(args.prompts, args.batch, args.samples, 1, args.epochs_seen)
    rollouts = make_rollouts(16 * args.samples, args.synthetic_length, args.samples, 0.01, 0) \
        if args.synthetic else trace_rollouts(args.trace)
    meas = measure(rollouts, args.backend)
    meas["source"] = "bench_store synthetic rollouts" if args.synthetic else args.trace
    bpt = meas["bytes_per_token"] if args.bytes_per_token is None else args.bytes_per_token
    links = [float(x) for x in args.link_gbps.split(",") if x.strip()]
    rows = project(meas, bpt, _ints(args.lengths), _ints(args.engines), [1, None], links,
                   args.step_time_s, base)
    out = {"assumptions": {
        "shape": {k: v for k, v in asdict(base).items() if k != "length"}
                 | {"lengths": _ints(args.lengths)},
        "window": "visits of the prompt kept (1 = latest visit, null = all epochs_seen visits)",
        "bytes_per_token": bpt,
        "bytes_per_token_source": f"measured (bench_store.store_footprint of {meas['source']})"
                                  if args.bytes_per_token is None else "given (--bytes-per-token)",
        "link_gbps": links, "link": "assumed bandwidth of the driver's one link",
        "step_time_s": args.step_time_s, "step_time": "assumed parameter, not measured",
        "placement": "in-engine 'random': uniform random engine per visit; 'affinity': always "
                     "the same engine",
        "critical_path": "driver serialization + link + engine export/import (1/E of the "
                         "tokens per engine), not overlapped with the step"},
        "measured": meas, "rows": rows}
    print(f"dapo_projection: {bpt:.0f} B per stored token, {meas['serialized_bytes_per_token']:.2f} "
          f"B per token pickled, pickle+copy+unpickle {meas['serialize_bytes_per_s'] / 1e9:.2f} GB/s, "
          f"export {meas['export_tokens_per_s'] / 1e6:.1f} M tok/s, import "
          f"{meas['import_tokens_per_s'] / 1e6:.2f} M tok/s; step {args.step_time_s:.0f} s (assumed)")
    print(format_table(rows))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
