"""Serving throughput through the HTTP server at batch 1..32: vanilla vs RHYME, side by side.

Both servers (``python -m rhyme_sglang.launch_server``, loopback ports) run for the whole
benchmark, and their timed rounds alternate: for each batch size, ``--repeats`` rounds per
mode, vanilla first in even repeats and RHYME first in odd ones (an idle server sleeps on its
sockets, so the one being timed has the machine). Drift of a shared machine then hits both
modes alike, and the spread between a mode's own repeats is reported as the noise the ratio
is judged against. A round is ``batch`` concurrent ``/generate`` requests (temperature 1.0,
``--max-new-tokens``, ignore_eos, so every request produces the same token count). There are 8
chat questions; a batch of more than 8 repeats them (like G samples of a prompt).

RHYME's history is exactly one round: after a warm-up round of every question (the history
epoch, then ``/rhyme/advance_epoch``) the store is saved, and reloaded before every timed
round, so a timed round never drafts from an earlier one. RHYME picks each step's verify width
(1..16) or a plain decode with its cost model, so it should never be slower than vanilla. The
JSON keeps every round, each round's time breakdown (``/rhyme/breakdown``, served by both
modes: decode steps by kind, prefill, scheduling) and RHYME's cost model.

    python -m benchmarks.bench_serving [--model smollm2] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_json

MODES = {"vanilla": [], "rhyme": ["--speculative-algorithm", "RHYME", "--speculative-num-draft-tokens", "17"]}
QUESTIONS = ["What is 7 + 5?", "Name the capital of France.", "What is 9 - 4?",
             "Give a synonym of happy.", "What is 3 * 3?", "Name a primary colour.",
             "What is 12 - 7?", "What is 6 + 8?"]
HISTORY = "history.snap"


def _prompts(model_path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _round(url: str, prompts, batch: int, max_new_tokens: int) -> tuple[float, int]:
    from rhyme_sglang.server_process import post

    body = lambda p: {"input_ids": p, "sampling_params": {  # noqa: E731
        "temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as pool:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        results = list(pool.map(lambda p: post(url + "/generate", body(p), timeout=600),
                                batch_prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(len(r[1]["output_ids"]) for r in results if r[0] == 200)
    return elapsed, tokens


def _decode_summary(breakdown: dict) -> dict:
    """A round's breakdown, compacted: steps, seconds, tokens emitted and forward rows per decode
    kind, prefill, the rest."""
    out = {kind: {"steps": v["steps"], "seconds": round(v["seconds"], 3), "tokens": v.get("tokens"),
                  "rows": v.get("rows")}
           for kind, v in sorted(breakdown.get("decode", {}).items())}
    pre = breakdown.get("prefill", {})
    out["prefill"] = {"steps": pre.get("steps", 0), "seconds": round(pre.get("seconds", 0.0), 3),
                      "tokens": pre.get("tokens", 0), "cached_tokens": pre.get("cached_tokens", 0)}
    for key in ("draft_s", "postprocess_s", "schedule_s"):
        out[key] = round(breakdown.get(key, 0.0), 3)
    out["minor_faults"] = breakdown.get("minor_faults")  # the scheduler's, in the round
    return out


def judge(vanilla: list, rhyme: list) -> dict:
    """Median tok/s of each mode's repeats, their ratio, and the noise it is judged against: the
    largest spread (max - min over median) of either mode's own repeats."""
    med = {"vanilla": statistics.median(vanilla), "rhyme": statistics.median(rhyme)}
    noise = max((max(xs) - min(xs)) / statistics.median(xs) for xs in (vanilla, rhyme))
    ratio = med["rhyme"] / med["vanilla"]
    verdict = "faster" if ratio >= 1.0 else "within noise" if ratio >= 1.0 - noise else "slower"
    return {"vanilla_tok_s": med["vanilla"], "rhyme_tok_s": med["rhyme"], "ratio": ratio,
            "noise": noise, "verdict": verdict}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per mode and batch")
    parser.add_argument("--dtype", default="auto",
                        help="auto (measured: bf16 only where native) | float32 | bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.machine import cpu_flags
    from rhyme_sglang.models import resolve_model_path
    from rhyme_sglang.server_process import ServerProcess as Server, get, post

    model_path = resolve_model_path(args.model)
    prompts = _prompts(model_path)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = resolve_dtype(args.dtype)
    report = {"model": args.model, "dtype": dtype, "cpu_flags": cpu_flags(),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "design": "both servers up, timed rounds alternate between modes; RHYME reloads "
                        "one round of history before each", "modes": {}}
    snap_dir = tempfile.mkdtemp(prefix="bench_serving_snap_")
    servers = {}
    try:
        started = time.perf_counter()
        for mode, flags in MODES.items():
            extra = ["--rhyme-snapshot-dir", snap_dir] if mode == "rhyme" else []
            servers[mode] = Server(["--model-path", model_path, "--dtype", dtype, *flags, *extra],
                                   f"/tmp/bench_serving_{mode}.log")
        for mode, srv in servers.items():
            srv.wait_ready(timeout=600)
            report["modes"][mode] = {"rounds": {}}
        report["servers_start_s"] = time.perf_counter() - started
        url = {mode: srv.url for mode, srv in servers.items()}
        for mode in servers:  # warm-up; for RHYME the one round of history
            _round(url[mode], prompts, max(batches), args.max_new_tokens)
        for path, body in (("/rhyme/advance_epoch", {}), ("/rhyme/save", {"path": HISTORY})):
            status, out = post(url["rhyme"] + path, body, timeout=120)
            if status != 200:
                raise RuntimeError(f"{path}: {status} {out}")
        for b in batches:
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for mode in order:
                    if mode == "rhyme":
                        status, out = post(url[mode] + "/rhyme/load", {"path": HISTORY}, timeout=120)
                        if status != 200:
                            raise RuntimeError(f"/rhyme/load: {status} {out}")
                    post(url[mode] + "/rhyme/breakdown", {"reset": True}, timeout=60)
                    elapsed, tokens = _round(url[mode], prompts, b, args.max_new_tokens)
                    status, breakdown = get(url[mode] + "/rhyme/breakdown", timeout=60)
                    row = {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
                           "breakdown": _decode_summary(breakdown) if status == 200 else None}
                    report["modes"][mode]["rounds"].setdefault(str(b), []).append(row)
                    print(f"batch {b} repeat {rep} {mode}: {tokens / elapsed:.1f} tok/s", flush=True)
        status, stats = get(url["rhyme"] + "/rhyme/stats", timeout=60)
        if status == 200:
            report["modes"]["rhyme"]["decode_steps"] = stats.get("decode_steps")
            report["modes"]["rhyme"]["cost_model"] = stats.get("cost_model")
    finally:
        for srv in servers.values():
            srv.stop()
    rounds = {mode: report["modes"][mode]["rounds"] for mode in MODES}
    report["batches"] = {
        str(b): judge([r["tokens_per_s"] for r in rounds["vanilla"][str(b)]],
                      [r["tokens_per_s"] for r in rounds["rhyme"][str(b)]]) for b in batches}
    report["speedup_rhyme_vs_vanilla"] = {b: v["ratio"] for b, v in report["batches"].items()}
    print("bench_serving %s (median of %d alternating rounds): " % (args.model, args.repeats) + "; ".join(
        f"batch {b}: vanilla {v['vanilla_tok_s']:.1f} tok/s, rhyme {v['rhyme_tok_s']:.1f} tok/s "
        f"(x{v['ratio']:.2f}, noise {v['noise'] * 100:.0f}%: {v['verdict']})"
        for b, v in report["batches"].items()))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
