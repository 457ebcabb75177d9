"""Serving throughput through the HTTP server at batch 1..32: vanilla vs RHYME, side by side.

For each mode a ``python -m rhyme_sglang.launch_server`` process is started on a loopback port;
one warm-up round of the same chat prompts runs first (for RHYME it is also the history epoch),
then each batch size is timed: ``batch`` concurrent ``/generate`` requests (temperature 1.0,
``--max-new-tokens``, ignore_eos so every request produces the same token count). There are 8
chat questions; a batch of more than 8 repeats them (like G samples of a prompt). RHYME picks
each step's verify width (1..16) or a plain decode with its cost model, so it should never be
slower than vanilla; the JSON also keeps the cost model's choices (decode steps by kind).

    python -m benchmarks.bench_serving [--model smollm2] [--json OUT]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from pathlib import Path

from benchmarks.common import write_json

MODES = {"vanilla": [], "rhyme": ["--speculative-algorithm", "RHYME", "--speculative-num-draft-tokens", "17"]}
QUESTIONS = ["What is 7 + 5?", "Name the capital of France.", "What is 9 - 4?",
             "Give a synonym of happy.", "What is 3 * 3?", "Name a primary colour.",
             "What is 12 - 7?", "What is 6 + 8?"]


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--dtype", default="auto",
                        help="auto (measured: bf16 only where native) | float32 | bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from rhyme_sglang.machine import cpu_flags, resolve_dtype
    from rhyme_sglang.models import resolve_model_path
    from rhyme_sglang.server_process import ServerProcess as Server, get

    model_path = resolve_model_path(args.model)
    prompts = _prompts(model_path)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = resolve_dtype(args.dtype)
    report = {"model": args.model, "dtype": dtype, "cpu_flags": cpu_flags(),
              "max_new_tokens": args.max_new_tokens, "modes": {}}
    for mode, flags in MODES.items():
        log = Path(f"/tmp/bench_serving_{mode}.log")
        srv = Server(["--model-path", model_path, "--dtype", dtype, *flags], str(log))
        started = time.perf_counter()
        try:
            srv.wait_ready(timeout=300)
            start_s = time.perf_counter() - started
            _round(srv.url, prompts, max(batches), args.max_new_tokens)  # warm-up / history epoch
            rows = {}
            for b in batches:
                elapsed, tokens = _round(srv.url, prompts, b, args.max_new_tokens)
                rows[str(b)] = {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}
            report["modes"][mode] = {"server_start_s": start_s, "batches": rows}
            if mode == "rhyme":
                code, stats = get(srv.url + "/rhyme/stats", timeout=60)
                if code == 200:
                    report["modes"][mode]["decode_steps"] = stats.get("decode_steps")
                    report["modes"][mode]["cost_model"] = stats.get("cost_model")
        finally:
            srv.stop()
    report["speedup_rhyme_vs_vanilla"] = {
        b: report["modes"]["rhyme"]["batches"][b]["tokens_per_s"]
        / report["modes"]["vanilla"]["batches"][b]["tokens_per_s"] for b in map(str, batches)}
    print("bench_serving %s: " % args.model + "; ".join(
        f"batch {b}: vanilla {report['modes']['vanilla']['batches'][b]['tokens_per_s']:.0f} tok/s, "
        f"rhyme {report['modes']['rhyme']['batches'][b]['tokens_per_s']:.0f} tok/s "
        f"(x{report['speedup_rhyme_vs_vanilla'][b]:.2f})" for b in map(str, batches)))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
