"""Our CPU engine against HF ``generate``, its verify/plain step costs, and this machine's roofline,
in both dtypes, and what ``dtype auto`` picks here.

One run, side by side, for each of fp32 and bf16 (``--dtype both``, the default; same model,
greedy, same random prompts of ``--prompt-len`` tokens, ``--max-new-tokens`` tokens each with
ignore_eos), each against HF in the same dtype:

1. HF transformers ``generate`` at batch 1, 8, 32 (in this process, on as many threads as
   the engine computes with: its torch or its native kernels' threads, whichever is more);
2. a vanilla ``python -m rhyme_sglang.launch_server``: tok/s at batch 1, 8, 32, and the plain
   decode step time at batch 1..32 (a full round minus a one-token round, per step; the best
   of ``PLAIN_REPEATS`` rounds);
3. a RHYME server verifying ``--verify-width`` draft tokens per request (a forward of width + 1
   tokens per request): for each batch a history round, then the same prompts again (perfect
   history), every step a full verify of that width (no cost model, no per-request widths);
   verify/plain = the median verify step of the perfect round (``/rhyme/breakdown``'s step
   timeline) over the vanilla server's plain step at that batch;
4. the roofline, measured here on the engine's cores: stream bandwidth (a large copy) and the
   time of the model's linear layers at each row count (GEMMs on the real shapes, weights hot
   in cache). A step's bound is max(weight bytes / bandwidth, GEMM time); attention and
   sampling are not in it (short contexts here). This machine's bandwidth moves by up to 2x
   within minutes (a shared VM), so the copy is timed before and after each batch's rounds
   of both servers, and each step is judged against the mean of those two readings
   (``step_over_roofline``); against the run's best reading too
   (``step_over_roofline_best_bandwidth``, the strictest bound).

Then fp32's tok/s and plain steps against bf16's, and auto's tok/s against the faster dtype's
(``dtypes`` in the JSON; the top-level figures are auto's dtype, ``by_dtype`` holds both).

    python -m benchmarks.bench_cpu_engine [--model smollm2] [--dtype both] [--json OUT]
    python -m benchmarks.bench_cpu_engine --quick   # tiny model smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.common import timed_round as _round
from benchmarks.common import write_json

PLAIN_BATCHES = (1, 2, 4, 8, 16, 32)
THROUGHPUT_BATCHES = (1, 8, 32)
VERIFY_ROOFLINE_BATCHES = (1, 2, 4, 8)
# Rounds per batch of the vanilla server; its best is kept: one round on a time-shared 2-core
# machine is not a step's cost (a single round once read a batch-1 plain step of 35-36 ms that
# probes of the same server never reproduced: 25-29 ms).
PLAIN_REPEATS = 2


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


# ---- HF generate -----------------------------------------------------------------------------
def hf_throughput(model_path: str, dtype: str, prompts, batches, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()

    def run(batch: int, tokens: int) -> float:
        ids = torch.tensor(prompts[:batch])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
        elapsed = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == tokens
        return batch * tokens / elapsed

    run(max(batches), 4)  # warm-up
    return {str(b): run(b, new_tokens) for b in batches}


# ---- servers ---------------------------------------------------------------------------------
def vanilla_server(model_path: str, dtype: str, prompts, new_tokens: int) -> dict:
    """tok/s at THROUGHPUT_BATCHES, seconds per plain decode step at PLAIN_BATCHES and the
    stream bandwidth around each batch's rounds (GB/s, :func:`bandwidth_around`)."""
    from rhyme_sglang.server_process import ServerProcess

    srv = ServerProcess(["--model-path", model_path, "--dtype", dtype], "/tmp/bench_cpu_engine_vanilla.log")
    try:
        srv.wait_ready(timeout=600)
        _round(srv.url, prompts[:max(PLAIN_BATCHES)], 8)  # warm-up
        tok_s, step_s = {}, {}

        def rounds(b: int) -> None:
            steps, rates = [], []
            for _ in range(PLAIN_REPEATS):
                full, tokens = _round(srv.url, prompts[:b], new_tokens)
                one, _ = _round(srv.url, prompts[:b], 1)
                steps.append(max(full - one, 1e-9) / (new_tokens - 1))
                rates.append(tokens / full)
            step_s[str(b)] = min(steps)
            if b in THROUGHPUT_BATCHES:
                tok_s[str(b)] = max(rates)

        bandwidth = bandwidth_around(PLAIN_BATCHES, rounds)
        return {"tok_s": tok_s, "plain_step_s": step_s, "bandwidth_gb_s": bandwidth}
    finally:
        srv.stop()


def bandwidth_around(batches, rounds) -> dict:
    """Runs ``rounds(b)`` for each batch with a stream-bandwidth reading before the first and
    after each; returns ``{batch: GB/s}``, the mean of the readings just before and after that
    batch's rounds (the bandwidth its steps ran under)."""
    readings = [stream_bandwidth(mib=256, repeats=3) / 1e9]
    for b in batches:
        rounds(b)
        readings.append(stream_bandwidth(mib=256, repeats=3) / 1e9)
    return {str(b): (readings[i] + readings[i + 1]) / 2 for i, b in enumerate(batches)}


def step_costs(cost_model: dict, bucket: str, width: int):
    """(verify, plain) seconds of one bucket of ``/rhyme/stats`` ``cost_model``, either
    ``{"spec": s, "plain": s}`` or per draft width ``{"0": s, "<width>": s}`` ("0" = plain)."""
    table = cost_model.get("seconds_per_request_step") or cost_model.get("step_costs") or cost_model
    row = table.get(bucket) if isinstance(table, dict) else None
    if not isinstance(row, dict):
        return None, None
    plain = row.get("plain", row.get("0"))
    spec = row.get("spec", row.get(str(width)))
    if spec is None:  # the widest measured draft width
        widths = [int(k) for k, v in row.items() if k.isdigit() and int(k) > 0 and v]
        spec = row[str(max(widths))] if widths else None
    return spec, plain


def median_verify_step(breakdown: dict, width: int, min_steps: int = 3):
    """Median seconds per request-step of the verify steps at ``width`` in a
    ``/rhyme/breakdown`` timeline (``[t, kind, batch, seconds, tokens]``); None with fewer
    than ``min_steps`` of them. A median, because an exponential average of few steps keeps
    much of the first one, which at a new row count pays one-off set-up."""
    import statistics

    per_request = [seconds / batch for _t, kind, batch, seconds, _tokens
                   in breakdown.get("timeline", []) if kind == f"verify_w{width}" and batch]
    return statistics.median(per_request) if len(per_request) >= min_steps else None


def rhyme_server(model_path: str, dtype: str, vocab: int, prompt_len: int, new_tokens: int,
                 width: int, seed: int, vanilla_step_s: dict | None = None) -> dict:
    """verify/plain at PLAIN_BATCHES, each from a history round then a perfect-history round.

    The RHYME server verifies every request's ``width`` draft tokens at every decode step
    (``--rhyme-adaptive 0 --rhyme-ragged 0``: no cost-model choice, no per-request widths),
    so each verify step is the issue's tree of ``width + 1`` tokens per request. The verify
    cost is the median of the perfect-history round's steps (:func:`median_verify_step`; the
    cost model's average where too few ran); the plain cost is the vanilla server's measured
    plain step at that batch (``vanilla_step_s``, per whole step; ``plain_source``). Neither is
    read from the adaptive engine: its per-request widths run "width 8" steps with a few rows,
    and its plain steps are few and slow after idle gaps (the ratios swung from 0.87 to 6.2
    between neighbouring batch sizes)."""
    from rhyme_sglang.server_process import ServerProcess, get, post

    # --rhyme-cost-cache 0: no earlier engine's saved table
    srv = ServerProcess(["--model-path", model_path, "--dtype", dtype, "--speculative-algorithm",
                         "RHYME", "--speculative-num-draft-tokens", str(width + 1),
                         "--rhyme-cost-cache", "0", "--rhyme-adaptive", "0", "--rhyme-ragged", "0"],
                        "/tmp/bench_cpu_engine_rhyme.log")
    try:
        srv.wait_ready(timeout=600)
        _round(srv.url, _prompts(vocab, 4, prompt_len, seed + 99), 8)  # warm-up
        ratio, tok_s, raw, source = {}, {}, {}, {}

        def rounds(b: int) -> None:
            prompts = _prompts(vocab, b, prompt_len, seed + b)
            _round(srv.url, prompts, new_tokens)  # history
            post(srv.url + "/rhyme/breakdown", {"reset": True})  # the perfect round's steps only
            elapsed, tokens = _round(srv.url, prompts, new_tokens)
            tok_s[str(b)] = tokens / elapsed
            status, stats = get(srv.url + "/rhyme/stats")
            if status != 200:
                raise RuntimeError(f"/rhyme/stats: {status} {stats}")
            spec = median_verify_step(stats.get("breakdown", {}), width) or step_costs(stats.get("cost_model", {}), str(b), width)[0]
            plain, source[str(b)] = None, "vanilla_server"
            if vanilla_step_s and vanilla_step_s.get(str(b)):
                plain = vanilla_step_s[str(b)] / b
            if spec and plain:
                ratio[str(b)] = spec / plain
                raw[str(b)] = {"verify": spec, "plain": plain}

        bandwidth = bandwidth_around(PLAIN_BATCHES, rounds)
        return {"verify_over_plain": ratio, "perfect_history_tok_s": tok_s, "cost_model_s": raw,
                "plain_source": source, "bandwidth_gb_s": bandwidth}
    finally:
        srv.stop()


# ---- roofline --------------------------------------------------------------------------------
def linear_shapes(model_path: str) -> tuple[list[tuple[int, int]], int]:
    """(in, out) of one decoder layer's linears as sglang fuses them (qkv, o, gate_up, down),
    then the lm_head's; and the number of layers."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    layer = [(c.hidden_size, qkv), (c.num_attention_heads * head_dim, c.hidden_size),
             (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]
    return layer + [(c.hidden_size, c.vocab_size)], c.num_hidden_layers


def stream_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write)."""
    import torch

    src = torch.ones(mib * 2 ** 18)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_seconds(shapes, layers: int, dtype: str, rows: int, repeats: int = 3) -> dict:
    """Time of one forward's linears at ``rows`` tokens (best of ``repeats`` per shape), per
    kernel: ``plain`` (``F.linear``), ``packed`` (oneDNN with a packed weight, where it can
    pack), ``native`` (our few-row kernel, where it is built: fp32, and bf16 with avx512_bf16)
    and ``best`` (the fastest per shape: what this machine can do)."""
    import torch
    import torch.nn.functional as F

    from rhyme_sglang.cpu_backend import linear

    total = {"plain": 0.0, "packed": 0.0, "native": 0.0, "best": 0.0}
    for i, (k, n) in enumerate(shapes):
        w = torch.randn(n, k).to(getattr(torch, dtype))
        x = torch.randn(rows, k).to(getattr(torch, dtype))
        kernels = {"plain": lambda: F.linear(x, w)}
        packed = linear.pack(w)
        if packed is not None:
            kernels["packed"] = lambda: linear.packed_linear(x, packed, None)
        panels = linear.native_pack(w)
        if panels is not None:
            kernels["native"] = lambda: linear.native_linear(x, panels, n, None)
        times = {}
        for name, fn in kernels.items():
            fn()
            times[name] = min(_timed(fn) for _ in range(repeats))
        count = 1 if i == len(shapes) - 1 else layers
        for name, t in times.items():
            total[name] += t * count
        total["best"] += min(times.values()) * count
    return {name: t for name, t in total.items() if t > 0.0}


def roofline(model_path: str, dtype: str, row_counts) -> dict:
    import torch

    shapes, layers = linear_shapes(model_path)
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    params = sum(k * n for k, n in shapes[:-1]) * layers + shapes[-1][0] * shapes[-1][1]
    bandwidth = stream_bandwidth()
    gemm = {r: gemm_seconds(shapes, layers, dtype, r) for r in sorted(set(row_counts))}
    return {"bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": params * elem,
            "memory_s": params * elem / bandwidth,
            "gemm_s": {str(r): g["best"] for r, g in gemm.items()},
            "gemm_by_kernel_s": {str(r): g for r, g in gemm.items()},
            "gemm_gflop_s": {str(r): 2 * params * r / g["best"] / 1e9 for r, g in gemm.items()}}


def bound(roof: dict, rows: int, bandwidth_gb_s: float | None = None) -> float:
    """A step's lower bound at ``rows`` rows: max(weight bytes / bandwidth, GEMM time), with
    ``bandwidth_gb_s`` where given, else the roofline's own reading."""
    memory = roof["memory_s"] if bandwidth_gb_s is None else roof["weight_bytes"] / (bandwidth_gb_s * 1e9)
    return max(memory, roof["gemm_s"][str(rows)])


def step_over_roofline(report: dict, rows: int, at_step: bool = True) -> dict:
    """Plain steps (PLAIN_BATCHES) and verify steps of ``rows`` rows a request
    (VERIFY_ROOFLINE_BATCHES) over their bound: with the bandwidth read around each batch's
    rounds (``plain_bandwidth_gb_s`` / ``verify_bandwidth_gb_s``) when ``at_step``, else with
    ``report["roofline"]``'s reading."""
    plain_s, ratio, roof = report["plain_step_s"], report["verify_over_plain"], report["roofline"]
    plain_bw = report.get("plain_bandwidth_gb_s", {}) if at_step else {}
    verify_bw = report.get("verify_bandwidth_gb_s", {}) if at_step else {}
    return {"plain": {str(b): plain_s[str(b)] / bound(roof, b, plain_bw.get(str(b))) for b in PLAIN_BATCHES},
            "verify": {str(b): ratio[str(b)] * plain_s[str(b)] / bound(roof, b * rows, verify_bw.get(str(b)))
                       for b in VERIFY_ROOFLINE_BATCHES if str(b) in ratio}}


def share_bandwidth(by_dtype: dict, rows: int) -> None:
    """Every dtype's roofline with the run's best stream bandwidth reading (the roofline's own
    and those around the servers' rounds, of either dtype), and its step ratios against it in
    ``step_over_roofline_best_bandwidth``: the strictest bound this run measured."""
    best = max(max([r["roofline"]["bandwidth_gb_s"], *r.get("plain_bandwidth_gb_s", {}).values(),
                    *r.get("verify_bandwidth_gb_s", {}).values()]) for r in by_dtype.values())
    for report in by_dtype.values():
        roof = report["roofline"]
        roof["own_bandwidth_gb_s"], roof["bandwidth_gb_s"] = roof["bandwidth_gb_s"], best
        roof["memory_s"] = roof["weight_bytes"] / (best * 1e9)
        report["step_over_roofline_best_bandwidth"] = step_over_roofline(report, rows, at_step=False)


# ---- main ----------------------------------------------------------------------------------
def measure_dtype(args, dtype: str, model_path: str, vocab: int, prompts) -> dict:
    """Every figure of one dtype: HF, the roofline, the vanilla and the RHYME server."""
    width = args.verify_width
    rows = width + 1  # a verify forward: the last accepted token + ``width`` draft tokens
    hf = hf_throughput(model_path, dtype, prompts, THROUGHPUT_BATCHES, args.max_new_tokens)
    roof = roofline(model_path, dtype, list(PLAIN_BATCHES) + [b * rows for b in VERIFY_ROOFLINE_BATCHES])
    vanilla = vanilla_server(model_path, dtype, prompts, args.max_new_tokens)
    rhyme = rhyme_server(model_path, dtype, vocab, args.prompt_len, args.max_new_tokens, width,
                         args.seed, vanilla["plain_step_s"])
    report = {
        "dtype": dtype, "hf_tok_s": hf, "engine_tok_s": vanilla["tok_s"],
        "verify_over_plain": rhyme["verify_over_plain"], "plain_step_s": vanilla["plain_step_s"],
        "perfect_history_tok_s": rhyme["perfect_history_tok_s"],
        "cost_model_s": rhyme["cost_model_s"], "plain_source": rhyme["plain_source"],
        "roofline": roof, "plain_bandwidth_gb_s": vanilla["bandwidth_gb_s"],
        "verify_bandwidth_gb_s": rhyme["bandwidth_gb_s"],
    }
    report["step_over_roofline"] = step_over_roofline(report, rows)
    return report


def compare_dtypes(by_dtype: dict, auto: str) -> dict:
    """With both dtypes measured: fp32's engine tok/s over bf16's, fp32's plain step time over
    bf16's (> 1: bf16's step is faster), and auto's tok/s over the faster dtype's at each batch
    (1.0: auto picked the faster)."""
    fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
    tok = {b: fp32["engine_tok_s"][b] / bf16["engine_tok_s"][b] for b in fp32["engine_tok_s"]}
    return {
        "fp32_over_bf16_tok_s": tok,
        "fp32_step_over_bf16": {b: fp32["plain_step_s"][b] / bf16["plain_step_s"][b]
                                for b in fp32["plain_step_s"]},
        "auto_over_best_tok_s": {b: by_dtype[auto]["engine_tok_s"][b]
                                 / max(d["engine_tok_s"][b] for d in by_dtype.values())
                                 for b in fp32["engine_tok_s"]},
    }


def summary_line(args, report: dict, threads: int, kernels: int) -> str:
    """One dtype's figures: engine vs HF tok/s, verify/plain, step/roofline."""
    hf, ratio = report["hf_tok_s"], report["verify_over_plain"]
    return (f"bench_cpu_engine {args.model} {report['dtype']}, {threads} torch + {kernels} kernel "
            f"thread(s) (HF {max(threads, kernels)}): " + "; ".join(
                f"batch {b}: engine {report['engine_tok_s'][b]:.0f} tok/s vs HF {hf[b]:.0f} "
                f"(x{report['engine_tok_s'][b] / hf[b]:.2f})" for b in hf)
            + " | verify/plain " + ", ".join(f"{b}: {r:.2f}" for b, r in ratio.items())
            + "".join(f" | step/roofline{label} plain " + ", ".join(
                f"{b}: {r:.2f}" for b, r in report[key]["plain"].items())
                + " verify " + ", ".join(f"{b}: {r:.2f}" for b, r in report[key]["verify"].items())
                for key, label in (("step_over_roofline", " (bandwidth at the step)"),
                                   ("step_over_roofline_best_bandwidth", " (run's best bandwidth)"))
                if key in report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_engine")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="both",
                        help="both (float32 and bfloat16, and what auto picks) | auto | float32 | bfloat16")
    parser.add_argument("--threads", default="auto",
                        help="compute threads of the engine and HF (RHYME_CPU_THREADS); auto = default rule")
    parser.add_argument("--kernel-threads", default="auto",
                        help="native kernel threads of the engine (RHYME_KERNEL_THREADS); auto = "
                             "default rule")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--verify-width", type=int, default=8,
                        help="draft tokens per request in a verify step (8: a 9-token forward)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 tokens (smoke run)")
    parser.add_argument("--json", default="out/cpu_engine.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.max_new_tokens, args.prompt_len = "tiny", 16, 16
    if args.threads != "auto":
        os.environ["RHYME_CPU_THREADS"] = str(int(args.threads))
    if args.kernel_threads != "auto":
        os.environ["RHYME_KERNEL_THREADS"] = str(int(args.kernel_threads))
    from rhyme_sglang import settings

    settings.prepare_cpu_env()
    settings.reload()  # the thread switches just set

    import torch
    from transformers import AutoConfig

    from rhyme_sglang.dtypes import decode_probe, resolve_dtype
    from rhyme_sglang.machine import (choose_kernel_threads, choose_scheduler_threads, cpu_flags,
                                      kernel_threads_from_env, set_kernel_threads,
                                      threads_from_env, usable_cores)
    from rhyme_sglang.models import resolve_model_path

    torch.manual_seed(args.seed)
    auto = resolve_dtype("auto")
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (resolve_dtype(args.dtype),)
    threads = choose_scheduler_threads(threads_from_env(), usable_cores())
    kernels = choose_kernel_threads(kernel_threads_from_env(), usable_cores())
    # HF and the roofline get the cores the engine computes on (its torch threads or its
    # native kernels' threads, whichever is more)
    torch.set_num_threads(max(threads, kernels))
    set_kernel_threads(kernels)
    model_path = resolve_model_path(args.model)
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = _prompts(vocab, max(PLAIN_BATCHES), args.prompt_len, args.seed)

    by_dtype = {d: measure_dtype(args, d, model_path, vocab, prompts) for d in dtypes}
    share_bandwidth(by_dtype, args.verify_width + 1)
    probe = decode_probe()
    # the top-level figures are auto's dtype where it ran, else the one dtype asked for
    report = {**by_dtype.get(auto, by_dtype[dtypes[0]]),
              "cpu_flags": cpu_flags(), "model": args.model, "threads": threads,
              "kernel_threads": kernels, "hf_threads": max(threads, kernels),
              "max_new_tokens": args.max_new_tokens, "prompt_len": args.prompt_len,
              "verify_width": args.verify_width, "auto_dtype": auto,
              "decode_probe": {"float32": probe.float32, "bfloat16": probe.bfloat16,
                               "describe": probe.describe()},
              "by_dtype": by_dtype}
    flags = " ".join(report["cpu_flags"]) or "-"
    for d in dtypes:
        print(summary_line(args, by_dtype[d], threads, kernels) + f" | CPU flags {flags}")
    if len(by_dtype) == 2:
        report["dtypes"] = compare_dtypes(by_dtype, auto)
        c = report["dtypes"]
        print(f"bench_cpu_engine {args.model} auto -> {auto} ({probe.describe()}): fp32/bf16 tok/s "
              + ", ".join(f"{b}: x{r:.2f}" for b, r in c["fp32_over_bf16_tok_s"].items())
              + "; bf16 plain step faster than fp32's by " + ", ".join(
                  f"{b}: x{r:.2f}" for b, r in c["fp32_step_over_bf16"].items())
              + "; auto/best tok/s " + ", ".join(
                  f"{b}: {r:.2f}" for b, r in c["auto_over_best_tok_s"].items())
              + f" | CPU flags {flags}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
