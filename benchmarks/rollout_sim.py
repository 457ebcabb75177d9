"""Trace-driven rollout simulator: projected makespan of every draft source under a cost table.

Replays a trace (notes/trace-format.md) epoch by epoch as an RL rollout: each epoch's prompt
groups are assigned to ``--engines`` engines (``rl_driver.balance.assign_groups``: LPT on
predicted group loads with affinity, or round robin), each engine runs continuous batching
with ``--max-running`` slots and its waiting queue in FCFS or longest-predicted-first order
(:mod:`benchmarks.ordering_sim`, ``rhyme_sglang.core.lpt_group_order``), and overrunning
requests migrate to idle engines. Predicted lengths come from the project's ``LengthStats``
fed with earlier epochs. Every decode step asks the mode's draft source for each running
request's draft (the replay's implementations, ``benchmarks.replay.make_source``: the real
``DraftStore`` for RHYME), picks the step's verify width, accepts the longest draft path
equal to the trace's tokens (the replay protocol) plus the bonus token, and charges the
step's seconds from the cost table at the running batch's mean context.

Modes (``MODES``): ``vanilla`` (plain decode), ``ngram`` (SGLang's NGRAM corpus, tree, every
step verifies the full width as SGLang pads it), ``suffix`` (ArcticInference suffix decoding;
needs scripts/build_arctic_suffix.sh), ``rhymerl`` (the RhymeRL recipe), ``rhyme`` (the
DraftStore with the real cost model choosing plain or a width per step:
``SpecCostModel.decide`` on ``draft.expected_accepts``, drafts cut by
``draft.truncate``, with the engine's critical-path ``Horizon`` from each request's predicted
length and the waiting queue unless ``--no-horizon``) and ``rhyme_fixed`` (the DraftStore at full width every step). suffix and
rhymerl verify ragged drafts (each request its own draft; the step costs the table's cost at
the batch's mean draft length, as vLLM-style ragged verification does). RHYME modes order queues LPT, the others FCFS
(``--order`` overrides).

Cost tables (``--cost-table``): a ``benchmarks.gpu_cost_curve`` table (measured or roofline:
seconds per step vs batch, width and context, interpolated linearly), a cost model's
``as_dict()`` (seconds per request-step per batch bucket and width, this machine's measured
table), or ``cpu``: each mode's engine's measured steps (its breakdown timelines, else its
cost model), read from ``--validate``.
Prefill is charged as one forward over the admitted requests' prompt tokens (and prompt +
prefix after a migration) from the same table's tokens-per-forward curve.

Scaling to the papers' shape: ``--copies C`` repeats every prompt group C times, each copy on
a disjoint token alphabet (tokens + c * vocab) so copies never draft from one another;
``--length-scale M`` makes each trace step stand for M identical steps (a response of L
tokens costs M * L decode tokens at context prompt + M * position, with the trace's
acceptance pattern), so a 300-token trace projects 10k-token responses.

Validation (``--validate BENCH_ROLLOUT_JSON``): replays each mode of a measured
``bench_rollout`` run on that mode's own responses and compares makespans per epoch.
Required fields of that JSON (``VALIDATE_SCHEMA``)::

    {"config": {"max_running_requests": int, "num_engines": int,     # 1 if absent
                "num_draft_tokens": int | {MODE: int | null}},       # SGLang's, k = n - 1
     "modes": {"vanilla" | "ngram" | "rhyme" | "rhyme_fixed": {
         "trace": "path of this mode's responses, all epochs (trace format; relative
                   paths are relative to the JSON file)",
         "epochs": {"<e>": {"makespan_s": float}},                  # measured, e >= 1
         "cost_model": SpecCostModel.as_dict()}}}                   # the engine's table

Each mode is charged its own engine's measured steps when the JSON has bench_rollout's
``"breakdown": {MODE: [{"timeline": [[t, kind, batch, seconds, tokens], ...]}]}`` (``TimelineTable``:
vanilla SGLang's plain steps run under its overlap scheduler and cost less than RHYME's
synchronous ones), else the cost model. A mode whose trace starts at its timed epochs gets
vanilla's earlier epochs as its history (bench_rollout gave it the shared trajectory's).
Also accepted: bench_rollout's own layout, ``"per_epoch": {MODE: [{"epoch": e, "makespan_s":
f}, ...]}`` for the epochs and ``modes.MODE.rhyme_stats.cost_model`` for the table; a mode
without a cost model (vanilla, ngram) uses the rhyme mode's. A RHYME mode's trace must hold
the history epochs it imported (epochs before the timed ones) as well as its own epochs.

    python -m benchmarks.rollout_sim --traces PATH --cost-table PATH|cpu \
        [--validate BENCH_ROLLOUT_JSON] --json OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

from rhyme_sglang.core import LengthStats, read_trace
from rhyme_sglang.core.cost_model import SpecCostModel, default_widths
from rhyme_sglang.core.horizon import Horizon, remaining_tokens
from rhyme_sglang.core.draft import Draft, accepted_length, expected_accepts, truncate
from rhyme_sglang.core.trace import TraceRecord
from rl_driver.balance import assign_groups

from .cost_tables import CostModelTable, TimelineTable, load_table
from .ordering_sim import Migration, SimRequest, Stepper, simulate
from .peers.base import request_id

logger = logging.getLogger("benchmarks.rollout_sim")
VALIDATE_SCHEMA = __doc__[__doc__.index("    {\"config\""):__doc__.index("    python -m")].rstrip()


@dataclass(frozen=True)
class Mode:
    source: Optional[str]  # replay source name; None = plain decoding
    width: str  # "plain", "adaptive" (the cost model), "full" (always k), "ragged" (own drafts)
    order: str  # waiting-queue policy
    group_prefill: bool = False  # siblings wait a pass and prefill from the cache (RHYME)


MODES = {
    "vanilla": Mode(None, "plain", "fcfs"),
    "ngram": Mode("sglang-ngram-tree", "full", "fcfs"),
    "suffix": Mode("suffix", "ragged", "fcfs"),
    "rhymerl": Mode("histospec", "ragged", "fcfs"),
    "rhyme": Mode("rhyme", "adaptive", "lpt", group_prefill=True),
    "rhyme_fixed": Mode("rhyme", "full", "lpt", group_prefill=True),
}


class PrefixCache:
    """One engine's prompt prefix cache (a token trie, never evicted within an epoch), as
    SGLang's radix cache serves prompts: a request prefills its prompt less the longest cached
    prefix, at least its last token. Prompts prefilled in one pass are cached after it."""

    def __init__(self) -> None:
        self._root: dict = {}

    def cached(self, tokens: Sequence[int]) -> int:
        node, n = self._root, 0
        for t in tokens:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        node = self._root
        for t in tokens:
            node = node.setdefault(t, {})

    def admit(self, requests: Sequence, group_prefill: bool, length_scale: int = 1) -> int:
        """Tokens one admission pass prefills. Without ``group_prefill`` every request of the
        pass sees only what earlier passes cached; with it, a sibling of a request earlier in
        the pass is charged as if it prefilled a pass later from its leader's cached prompt
        (the one-pass delay is not modelled)."""
        tokens, leaders = 0, set()
        for r in requests:
            prompt = r.payload.prompt_token_ids
            hit = self.cached(prompt)
            if group_prefill and r.group in leaders:
                hit = len(prompt)
            tokens += max(1, len(prompt) - hit) + length_scale * r.done
            leaders.add(r.group)
        for r in requests:
            self.insert(r.payload.prompt_token_ids)
        return tokens


# ----------------------------------------------------------------------------- workload
def scale_records(records: Sequence[TraceRecord], copies: int) -> List[TraceRecord]:
    """``copies`` copies of every record, copy c on tokens + c * vocab under prompt id
    ``<id>~c`` (copy 0 is the trace itself)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if copies == 1:
        return list(records)
    vocab = 1 + max(max(r.prompt_token_ids + r.response_token_ids, default=0) for r in records)
    out = []
    for c in range(copies):
        for r in records:
            if c == 0:
                out.append(r)
                continue
            out.append(replace(r, prompt_id=f"{r.prompt_id}~{c}",
                               prompt_token_ids=[t + c * vocab for t in r.prompt_token_ids],
                               response_token_ids=[t + c * vocab for t in r.response_token_ids]))
    return out


@dataclass(frozen=True)
class SimConfig:
    k: int = 8  # most draft tokens per request (the largest verify width)
    max_running: int = 256
    engines: int = 1
    assign: str = "lpt"
    migrate: bool = True
    length_scale: int = 1
    order: Optional[str] = None  # None = the mode's own
    prefill: bool = True
    horizon: bool = True  # the cost model counts useful tokens (the critical path), as the engine does

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_running < 1 or self.engines < 1 or self.length_scale < 1:
            raise ValueError(f"k, max_running, engines and length_scale must be >= 1: {self}")
        if self.assign not in ("lpt", "round_robin"):
            raise ValueError(f"assign must be 'lpt' or 'round_robin', got {self.assign!r}")
        if self.order not in (None, "lpt", "fcfs"):
            raise ValueError(f"order must be 'lpt' or 'fcfs', got {self.order!r}")


class TraceStepper(Stepper):
    """Steps of one mode over trace records: drafts, width choice, acceptance, cost."""

    def __init__(self, mode: Mode, source, table, cfg: SimConfig,
                 cost_model: Optional[SpecCostModel]) -> None:
        self.mode, self.source, self.table, self.cfg, self.cm = mode, source, table, cfg, cost_model
        self.tokens = self.verify_steps = self.plain_steps = self.accepted = self.request_steps = 0
        self.prefilled = 0
        self.prefill_s: Dict[int, float] = {}  # per engine
        self._caches: Dict[int, PrefixCache] = {}
        self._queued = 0.0  # the stepping engine's waiting queue, predicted tokens

    def queue(self, engine, waiting):
        if self.cm is not None and self.cfg.horizon:
            self._queued = sum(remaining_tokens(r.predicted, r.done) for r in waiting)

    def admit(self, engine, requests):
        if self.source is not None:
            for r in requests:
                if r.done == 0 and r.migrations == 0:
                    self.source.start(r.payload)
        if not self.cfg.prefill:
            return 0.0
        cache = self._caches.setdefault(engine, PrefixCache())
        tokens = cache.admit(requests, self.mode.group_prefill, self.cfg.length_scale)
        self.prefilled += tokens
        seconds = self.table.forward_seconds(tokens)
        self.prefill_s[engine] = self.prefill_s.get(engine, 0.0) + seconds
        return seconds

    def _drafts(self, running) -> List[Draft]:
        k = self.cfg.k
        return [self.source.propose(r.payload, r.payload.response_token_ids[:r.done], k)
                for r in running]

    def _width(self, batch: int, drafts: List[Draft], running=()):
        kind = self.mode.width
        if kind == "plain" or not any(drafts):
            return 0, drafts, []
        if kind == "full":
            return self.cfg.k, drafts, []
        if kind == "ragged":  # each request verifies its own draft: mean draft length per request
            return sum(len(d) for d in drafts) / batch, drafts, []
        per_request = [expected_accepts(d, self.cm.widths) for d in drafts]
        horizon = critical = None
        if self.cfg.horizon:  # as the engine: the prompt's predicted length, the queue's
            horizon = Horizon(tuple(remaining_tokens(r.predicted, r.done) for r in running),
                              self._queued)
            critical = self.cm.critical_expected(per_request, horizon)
        w = self.cm.decide(batch, expected=self.cm.batch_expected(per_request), calibrated=True,
                           horizon=horizon, critical=critical).width
        return w, ([truncate(d, w) for d in drafts] if w else drafts), [e.get(w, 0.0) for e in per_request]

    def step(self, engine, running):
        cfg, b = self.cfg, len(running)
        drafts = self._drafts(running) if self.source is not None else [Draft()] * b
        width, drafts, predicted = self._width(b, drafts, running)
        emitted, accepted = [], 0
        for i, (r, d) in enumerate(zip(running, drafts)):
            ref = r.payload.response_token_ids
            a = accepted_length(d, ref[r.done:]) if width else 0
            if width:
                self.source.feedback(r.payload, len(d), a)
                if self.cm is not None and predicted:  # per request, as the engine calibrates
                    self.cm.observe_acceptance(predicted[i], a)
            n = min(a + 1, r.length - r.done)
            if self.source is not None:
                self.source.advance(r.payload, ref[r.done:r.done + n])
            emitted.append(n)
            accepted += a
        context = statistics.fmean(r.prompt_len + cfg.length_scale * r.done for r in running)
        seconds = self.table.seconds(b, width, context)
        if self.cm is not None:
            self.cm.observe_step(b, width, seconds)
        self.tokens += sum(emitted)
        self.accepted += accepted
        self.request_steps += b
        if width:
            self.verify_steps += 1
        else:
            self.plain_steps += 1
        return cfg.length_scale * seconds, emitted

    def finish(self, engine, request):
        if self.source is not None:
            self.source.finish(request.payload, True)


def _by_epoch(records: Sequence[TraceRecord]) -> Dict[int, List[TraceRecord]]:
    out: Dict[int, List[TraceRecord]] = {}
    for r in sorted(records, key=lambda r: (r.epoch, r.prompt_id, r.sample)):
        out.setdefault(r.epoch, []).append(r)
    return out


def run_mode(name: str, records: Sequence[TraceRecord], table, cfg: SimConfig,
             backend: str = "auto", source=None) -> dict:
    """Simulate every epoch of ``records`` under mode ``name``; makespan sums epochs >= 1
    (epoch 0 builds the history, as in bench_rollout). ``source``: a prepared draft source
    (e.g. a store holding imported history) used instead of a fresh one of the mode's kind."""
    from .replay import make_source

    mode = MODES[name]
    if source is None and mode.source:
        source = make_source(mode.source, cfg.k, backend)
    cm = SpecCostModel(widths=default_widths(cfg.k)) if mode.width == "adaptive" else None
    order = cfg.order or mode.order
    lengths = LengthStats(default=float(statistics.fmean(len(r.response_token_ids) for r in records)))
    previous: Dict[str, int] = {}
    per_epoch = {}
    for epoch, recs in _by_epoch(records).items():
        groups = list(dict.fromkeys(r.prompt_id for r in recs))
        size = {g: 0 for g in groups}
        for r in recs:
            size[r.prompt_id] += 1
        loads = [lengths.predict(g) * size[g] for g in groups]
        plan = assign_groups(groups, loads, cfg.engines, cfg.assign, previous)
        where = {g: e for e, gs in enumerate(plan) for g in gs}
        queues: List[List[SimRequest]] = [[] for _ in range(cfg.engines)]
        for r in recs:
            queues[where[r.prompt_id]].append(SimRequest(
                request_id(r), r.prompt_id, len(r.response_token_ids), lengths.predict(r.prompt_id),
                len(r.prompt_token_ids), r))
        stepper = TraceStepper(mode, source, table, cfg, cm)
        t0 = time.perf_counter()
        res = simulate(queues, cfg.max_running, stepper, order, Migration() if cfg.migrate else None)
        if source is not None:
            source.end_epoch(epoch, recs, True)
        for r in recs:
            lengths.record(r.prompt_id, epoch, r.sample, len(r.response_token_ids))
        previous = where
        steps = stepper.verify_steps + stepper.plain_steps
        per_epoch[str(epoch)] = {
            "makespan_s": res["makespan_s"], "requests": len(recs), "tokens": stepper.tokens,
            "steps": steps, "verify_steps": stepper.verify_steps,
            "prefill_tokens": stepper.prefilled,
            "tau": stepper.tokens / max(1, stepper.request_steps),
            "accepted_draft_tokens": stepper.accepted, "migrations": res["migrations"],
            "engine_busy_s": res["engine_busy_s"],
            "engine_prefill_s": [stepper.prefill_s.get(e, 0.0) for e in range(cfg.engines)]}
        logger.info("%s epoch %d: %.2f s simulated (%.1f s wall)", name, epoch, res["makespan_s"],
                    time.perf_counter() - t0)
    timed = [v["makespan_s"] for e, v in per_epoch.items() if int(e) >= 1] or \
        [v["makespan_s"] for v in per_epoch.values()]
    out = {"makespan_s": sum(timed), "order": order, "per_epoch": per_epoch}
    if cm is not None:
        out["cost_model"] = cm.as_dict()
    return out


# ----------------------------------------------------------------------------- runs
def run(records, table_for, cfg: SimConfig, modes: Sequence[str], backend: str = "auto") -> dict:
    """Every available mode; ``table_for(mode)`` gives the cost table of that mode."""
    out = {"modes": {}, "skipped": {}}
    for name in modes:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; choose from {sorted(MODES)}")
        try:
            out["modes"][name] = run_mode(name, records, table_for(name), cfg, backend)
        except RuntimeError as exc:  # a peer that is not built or importable
            out["skipped"][name] = str(exc)
            logger.warning("skipping %s: %s", name, exc)
    base = out["modes"].get("vanilla", {}).get("makespan_s")
    out["speedup_vs_vanilla"] = {n: base / m["makespan_s"] for n, m in out["modes"].items()
                                 if base and m["makespan_s"]}
    return out


def validate(bench: dict, bench_dir: str, cfg: SimConfig, backend: str = "auto") -> dict:
    """Simulated vs measured makespans of a bench_rollout run (schema: ``VALIDATE_SCHEMA``)."""
    conf = bench.get("config", {})
    cfg = replace(cfg, max_running=int(conf.get("max_running_requests", cfg.max_running)),
                  engines=int(conf.get("num_engines", 1)), length_scale=1)
    draft_tokens = conf.get("num_draft_tokens", cfg.k + 1)  # one int, or one per mode
    per_mode = {}
    modes = bench.get("modes", {})
    for name, m in modes.items():
        if name not in MODES:
            logger.warning("validation: no simulator mode for %r", name)
            continue
        table = _measured_table(bench, name)
        measured = m.get("epochs") if isinstance(m.get("epochs"), dict) else \
            {str(e["epoch"]): e for e in bench.get("per_epoch", {}).get(name, [])}
        for key, value in (("trace", m.get("trace")), ("epochs", measured),
                           ("cost_model", table)):
            if not value:
                raise ValueError(f"validation JSON: mode {name!r} lacks {key!r}; schema:\n{VALIDATE_SCHEMA}")
        records = read_trace(_path(m["trace"], bench_dir))
        first = min(int(e) for e in measured)
        if min(r.epoch for r in records) >= first and modes.get("vanilla", {}).get("trace"):
            # a mode whose own trace starts at its timed epochs had its history from the
            # shared trajectory: vanilla's earlier epochs stand for it (same distribution)
            records = [r for r in read_trace(_path(modes["vanilla"]["trace"], bench_dir))
                       if r.epoch < first] + records
        n = draft_tokens.get(name) if isinstance(draft_tokens, dict) else draft_tokens
        mode_cfg = replace(cfg, k=int(n) - 1) if n else cfg
        sim = run_mode(name, records, table, mode_cfg, backend)
        epochs = {}
        for e, v in measured.items():
            if e in sim["per_epoch"] and int(e) >= 1:
                got = sim["per_epoch"][e]
                epochs[e] = {"measured_s": v["makespan_s"], "simulated_s": got["makespan_s"],
                             "measured_tau": v.get("tau"), "simulated_tau": got["tau"],
                             "simulated_steps": got["steps"]}
        measured = sum(v["measured_s"] for v in epochs.values())
        simulated = sum(v["simulated_s"] for v in epochs.values())
        per_mode[name] = {"measured_s": measured, "simulated_s": simulated,
                          "rel_error": abs(simulated - measured) / measured if measured else None,
                          "per_epoch": epochs}
    errors = [v["rel_error"] for v in per_mode.values() if v["rel_error"] is not None]
    return {"max_rel_error": max(errors) if errors else None, "per_mode": per_mode}


def _timelines(bench: dict, name: str) -> list:
    return [b["timeline"] for b in bench.get("breakdown", {}).get(name, []) if b.get("timeline")]


def _measured_table(bench: dict, name: str):
    """A mode's measured step costs: its engine's timelines, else its (or RHYME's) cost model."""
    timelines = _timelines(bench, name)
    if timelines:
        return TimelineTable(timelines, name)
    cost_model = _cost_model_of(bench["modes"], name)
    return CostModelTable(cost_model, name) if cost_model else None


def _path(path: str, base: str) -> str:
    return path if os.path.isabs(path) else os.path.join(base, path)


def _cost_model_of(modes: dict, name: str) -> Optional[dict]:
    """A mode's measured cost model (``cost_model`` or ``rhyme_stats.cost_model``); modes
    without one (vanilla, ngram) use the rhyme mode's, whose plain-decode cells they need."""
    def own(m):
        return m.get("cost_model") or m.get("rhyme_stats", {}).get("cost_model")
    return own(modes.get(name, {})) or own(modes.get("rhyme", {})) or own(modes.get("rhyme_fixed", {}))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--cost-table", required=True, help="a cost table JSON, or 'cpu' (needs --validate)")
    ap.add_argument("--validate", default=None, help="a bench_rollout JSON (see VALIDATE_SCHEMA)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--assign", choices=("lpt", "round_robin"), default="lpt")
    ap.add_argument("--order", choices=("lpt", "fcfs"), default=None, help="default: per mode")
    ap.add_argument("--no-migrate", action="store_true")
    ap.add_argument("--no-horizon", action="store_true",
                    help="RHYME's cost model scores batch throughput only, not the critical path")
    ap.add_argument("--copies", type=int, default=1, help="repeat every prompt group this often")
    ap.add_argument("--length-scale", type=int, default=1, help="each trace step stands for N steps")
    ap.add_argument("--max-epoch", type=int, default=None)
    ap.add_argument("--backend", choices=("auto", "native", "python"), default="auto")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = SimConfig(k=args.k, max_running=args.max_running, engines=args.engines,
                    assign=args.assign, migrate=not args.no_migrate,
                    length_scale=args.length_scale, order=args.order,
                    horizon=not args.no_horizon)
    bench = None
    if args.validate:
        with open(args.validate) as fh:
            bench = json.load(fh)
    if args.cost_table == "cpu":
        if bench is None:
            ap.error("--cost-table cpu reads each mode's measured cost model from --validate")
        tables = {n: _measured_table(bench, n) for n in bench["modes"]
                  if _measured_table(bench, n) is not None}
        fallback = tables.get("rhyme") or next(iter(tables.values()))
        table_for = lambda name: tables.get(name, fallback)  # noqa: E731
    else:
        table = load_table(args.cost_table)
        table_for = lambda name: table  # noqa: E731
    records = [r for r in read_trace(args.traces)
               if args.max_epoch is None or r.epoch <= args.max_epoch]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    result = {"cost_table": args.cost_table, "traces": args.traces, "config": vars(cfg),
              "copies": args.copies}
    result.update(run(scale_records(records, args.copies), table_for, cfg, modes, args.backend))
    result["validation"] = validate(bench, os.path.dirname(os.path.abspath(args.validate)), cfg,
                                    args.backend) if bench else None
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    sp = result["speedup_vs_vanilla"]
    val = result["validation"]
    print("rollout_sim " + ", ".join(f"{n} {m['makespan_s']:.2f} s" for n, m in result["modes"].items())
          + " | speedup vs vanilla: " + ", ".join(f"{n} {v:.2f}x" for n, v in sp.items())
          + (f" | validation max rel error {val['max_rel_error']:.3f}" if val and val["max_rel_error"]
             is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
