"""RHYME servers behind sglang-router vs direct per-engine calls: tau and rollout makespan.

Two RHYME servers (``--model``, default SmolLM2-135M) serve GRPO-like rollouts: ``--prompts``
prompts x ``--group`` samples, temperature 1.0, all requests of an epoch submitted at once,
``advance_epoch`` on both engines between epochs (the history epoch a weight update would
close; the policy itself does not change here). Routes compared, each from an empty history:

* ``direct``: the client sends each prompt group to a fixed engine (group i -> engine i mod 2),
  the driver's affinity: the baseline.
* ``router-manual``: ``sglang_router --policy manual``, the client sets ``x-smg-routing-key:
  <prompt id>`` (the router pins a key to one engine).
* ``router-cache-aware``: ``--policy cache_aware`` with no key (prefix-tree routing on the
  request text; load balancing when the load gap passes ``--balance-abs-threshold``).
* ``router-round-robin``: ``--policy round_robin``: no affinity (what a plain load balancer does).

Epoch 0 fills the history; epochs 1..E-1 are measured. In the last epoch ``--imbalance`` extra
long requests go to engine 0 directly while the rollout runs (load imbalance: does the policy
keep prompts on their history's engine, or move them?). Per epoch: makespan, tau from
``/rhyme/stats`` (tokens per verify step over both engines), and how many prompts have history
on both engines ("split"). Prints one summary line with the ratios vs direct and writes JSON.

    python -m benchmarks.bench_router [--model smollm2] [--epochs 3] [--json out/router.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import time
from pathlib import Path

from benchmarks.common import write_json

logger = logging.getLogger("benchmarks.bench_router")
ROUTES = ("direct", "router-manual", "router-cache-aware", "router-round-robin")
POLICY = {"router-manual": "manual", "router-cache-aware": "cache_aware",
          "router-round-robin": "round_robin"}


def _epoch_stats(urls) -> dict:
    from rhyme_sglang.server_process import get

    return {u: get(u + "/rhyme/stats")[1] for u in urls}


def _tau(before: dict, after: dict, epoch: int) -> float:
    """Tokens per verify step of ``epoch`` over all engines (from ``/rhyme/stats``)."""
    tokens = steps = 0
    for url, st in after.items():
        cur = st["per_epoch"].get(str(epoch), {})
        old = before[url]["per_epoch"].get(str(epoch), {})
        tokens += cur.get("tokens", 0) - old.get("tokens", 0)
        steps += cur.get("verify_steps", 0) - old.get("verify_steps", 0)
    return tokens / steps if steps else 1.0


def _split_prompts(urls, keys) -> int:
    """Prompts whose history is on more than one engine (keys: RHYME prompt keys)."""
    from rhyme_sglang.server_process import get

    return sum(sum(get(f"{u}/rhyme/history?prompt_id={key}")[0] == 200 for u in urls) > 1
               for key in keys)


def _rollout(target, prompts, args, route: str, seed: int, imbalance_url=None) -> dict:
    """One epoch: every (prompt, sample) request at once; returns makespan and tokens."""
    from rhyme_sglang.server_process import post

    urls = target if isinstance(target, list) else None

    def one(job):
        i, pid, ids, s = job
        url = urls[i % len(urls)] if urls else target
        headers = {"x-smg-routing-key": pid} if route == "router-manual" else None
        body = {"input_ids": ids, "sampling_params": {
            "temperature": 1.0, "max_new_tokens": args.max_new_tokens, "sampling_seed": seed + s,
            "custom_params": {"rhyme_prompt_id": pid, "rhyme_sample": s}}}
        status, out = post(url + "/generate", body, headers=headers, timeout=1200)
        if status != 200:
            raise RuntimeError(f"{route}: /generate -> {status}: {out}")
        return len(out["output_ids"])

    jobs = [(i, p.prompt_id, list(p.token_ids), s) for i, p in enumerate(prompts)
            for s in range(args.group)]
    extra = []
    with cf.ThreadPoolExecutor(len(jobs) + args.imbalance) as pool:
        if imbalance_url:
            filler = {"input_ids": list(prompts[0].token_ids)[:8], "sampling_params": {
                "temperature": 1.0, "max_new_tokens": 2 * args.max_new_tokens, "ignore_eos": True}}
            extra = [pool.submit(post, imbalance_url + "/generate", filler, None, 1200)
                     for _ in range(args.imbalance)]
            time.sleep(0.5)  # the filler is admitted first
        start = time.perf_counter()
        tokens = sum(pool.map(one, jobs))
        makespan = time.perf_counter() - start
        for f in extra:
            f.result()
    return {"makespan_s": makespan, "tokens": tokens}


def run_route(route, servers, prompts, args, logdir: Path) -> list:
    from rhyme_sglang.core import prompt_key
    from rhyme_sglang.server_process import RouterProcess, post

    urls = [s.url for s in servers]
    for u in urls:
        status, out = post(u + "/rhyme/reset", {})
        if status != 200:
            raise RuntimeError(f"reset {u}: {out}")
    router = None
    if route in POLICY:
        router = RouterProcess(urls, ["--policy", POLICY[route], "--balance-abs-threshold",
                                      str(args.balance_abs_threshold)],
                               str(logdir / f"router-{route}.log"))
        router.wait_ready(timeout=120)
    target = router.url if router else urls
    rows = []
    try:
        for epoch in range(args.epochs):
            before = _epoch_stats(urls)
            last = epoch == args.epochs - 1 and epoch > 0 and args.imbalance > 0
            row = _rollout(target, prompts, args, route, seed=1000 * epoch,
                           imbalance_url=urls[0] if last else None)
            after = _epoch_stats(urls)
            # sglang-router 0.3.2 drops custom_params: behind it prompts are keyed by token hash
            keys = [prompt_key(p.token_ids) if router else p.prompt_id for p in prompts]
            row.update(epoch=epoch, imbalance=last, tau=_tau(before, after, after[urls[0]]["epoch"]),
                       split_prompts=_split_prompts(urls, keys))
            rows.append(row)
            logger.info("%s epoch %d: %.1f s, tau %.2f, split %d", route, epoch,
                        row["makespan_s"], row["tau"], row["split_prompts"])
            for u in urls:
                post(u + "/rhyme/advance_epoch", {})
    finally:
        if router:
            router.stop()
    return rows


def summarize(rows: list) -> dict:
    measured = [r for r in rows if r["epoch"] > 0]
    steady = [r for r in measured if not r["imbalance"]]
    tau = lambda rs: sum(r["tau"] for r in rs) / len(rs) if rs else None  # noqa: E731
    return {"makespan_s": sum(r["makespan_s"] for r in measured),
            "tokens": sum(r["tokens"] for r in measured), "tau_steady": tau(steady),
            "tau_imbalance": tau([r for r in measured if r["imbalance"]]),
            "split_prompts_last": rows[-1]["split_prompts"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_router")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto",
                        help="auto (measured: bf16 only where native) | float32 | bfloat16")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--imbalance", type=int, default=6,
                        help="extra long requests sent to engine 0 during the last epoch")
    parser.add_argument("--balance-abs-threshold", type=int, default=4)
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default="/tmp/bench_router")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.machine import cpu_flags
    from rhyme_sglang.models import resolve_model_path
    from rhyme_sglang.server_process import ServerProcess
    from benchmarks.bench_rollout import build_prompts

    routes = args.routes.split(",")
    if "direct" not in routes or set(routes) - set(ROUTES):
        raise SystemExit(f"--routes must include direct and come from {ROUTES}")
    model_path = resolve_model_path(args.model)
    prompts, _ = build_prompts(model_path, args.prompts, ["chain_sum", "basic_arithmetic"],
                               args.seed)
    dtype = resolve_dtype(args.dtype)
    logdir = Path(args.workdir)
    logdir.mkdir(parents=True, exist_ok=True)
    servers = [ServerProcess(["--model-path", model_path, "--dtype", dtype,
                              "--speculative-algorithm", "RHYME",
                              "--speculative-num-draft-tokens", "8",
                              "--rhyme-snapshot-dir", str(logdir / f"snap{i}")],
                             str(logdir / f"server{i}.log")) for i in range(2)]
    report = {"model": args.model, "dtype": dtype, "cpu_flags": cpu_flags(),
              "args": vars(args), "routes": {}}
    try:
        for s in servers:
            s.wait_ready(timeout=600)
        _rollout([s.url for s in servers], prompts[:2], args, "direct", seed=99)  # warm-up
        for route in routes:
            rows = run_route(route, servers, prompts, args, logdir)
            report["routes"][route] = {"epochs": rows, **summarize(rows)}
    finally:
        for s in servers:
            s.stop()
    base = report["routes"]["direct"]
    parts = []
    for route in routes:
        r = report["routes"][route]
        r["makespan_vs_direct"] = r["makespan_s"] / base["makespan_s"]
        parts.append(f"{route}: {r['makespan_s']:.1f} s (x{base['makespan_s'] / r['makespan_s']:.2f}"
                     f" vs direct), tau {r['tau_steady']:.2f}"
                     + (f" / {r['tau_imbalance']:.2f} imbalanced" if r["tau_imbalance"] else "")
                     + f", split {r['split_prompts_last']}")
    print(f"bench_router {args.model} ({dtype}; cpu {','.join(report['cpu_flags'])}): "
          + "; ".join(parts))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
