"""Helpers every benchmark script shares."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import time
from pathlib import Path


def timed_round(url: str, prompts, tokens: int, temperature: float = 0.0) -> tuple[float, int]:
    """Send every prompt at once to the server at `url` (``ignore_eos``, `tokens` new tokens
    each); returns (seconds until the last reply, output tokens)."""
    from rhyme_sglang.server_process import post

    def one(p):
        return post(url + "/generate", {"input_ids": p, "sampling_params": {
            "temperature": temperature, "max_new_tokens": tokens, "ignore_eos": True}}, timeout=900)

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    bad = [r for r in results if r[0] != 200]
    if bad:
        raise RuntimeError(f"generate failed: {bad[0]}")
    return elapsed, sum(len(r[1]["output_ids"]) for r in results)


def epoch_total(runs, key: str) -> float:
    """``runs``' ``key`` summed over epochs, each epoch the mean of its rounds (a
    ``bench_rollout`` mode's makespan, tokens, ...; every run has an ``"epoch"``)."""
    by_epoch: dict = {}
    for r in runs:
        by_epoch.setdefault(r["epoch"], []).append(r[key])
    return sum(statistics.mean(v) for v in by_epoch.values())


def write_json(path, report: dict) -> None:
    """Write a benchmark report as indented JSON (no-op without a path; parents created)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=str))


def op_and_engine_parser(prog: str, prompt_len: int, repeats: int) -> argparse.ArgumentParser:
    """The flags shared by the op + two-servers benchmarks (bench_attention, bench_sampling);
    each adds its own (``--quick``, ``--json``, ...) before parsing."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto",
                        help="the engine's: auto (measured) | float32 | bfloat16")
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=repeats, help="op timings: best of N")
    parser.add_argument("--rounds", type=int, default=3,
                        help="engine rounds per batch and server (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-engine", action="store_true", help="the ops only")
    return parser


def servers_side_by_side(model_path: str, dtype: str, env_name: str, impls: tuple[str, str],
                         prompts, batches, new_tokens: int, rounds: int,
                         temperature: float = 0.0, log_prefix: str = "/tmp/bench") -> dict:
    """Two vanilla SGLang servers of one model up at once, differing only in ``env_name``
    (``impls[0]`` is the baseline, ``impls[1]`` the candidate). At each batch their rounds
    alternate (an idle server sleeps), so machine noise falls on both; medians are reported:
    tok/s of a ``new_tokens`` round and seconds per plain decode step (a full round minus a
    one-token round, over ``new_tokens - 1`` steps). The prompts are prefilled once first, so
    they are cached in every timed round."""
    import os
    import statistics

    from rhyme_sglang.server_process import ServerProcess

    servers = {}
    try:
        for impl in impls:
            os.environ[env_name] = impl  # the server process inherits it
            servers[impl] = ServerProcess(["--model-path", model_path, "--dtype", dtype],
                                          f"{log_prefix}_{impl}.log")
        os.environ.pop(env_name, None)
        for srv in servers.values():
            srv.wait_ready(timeout=600)
            timed_round(srv.url, prompts[:4], 4, temperature)  # warm-up
        out = {impl: {"tok_s": {}, "plain_step_s": {}} for impl in impls}
        for b in batches:
            full_s = {impl: [] for impl in impls}
            one_s = {impl: [] for impl in impls}
            for impl in impls:
                timed_round(servers[impl].url, prompts[:b], 1, temperature)
            for _ in range(rounds):
                for impl in impls:
                    full_s[impl].append(timed_round(servers[impl].url, prompts[:b], new_tokens,
                                               temperature)[0])
                    one_s[impl].append(timed_round(servers[impl].url, prompts[:b], 1, temperature)[0])
            for impl in impls:
                full, one = statistics.median(full_s[impl]), statistics.median(one_s[impl])
                out[impl]["tok_s"][str(b)] = b * new_tokens / full
                out[impl]["plain_step_s"][str(b)] = max(full - one, 1e-9) / (new_tokens - 1)
            print(f"  engine, batch {b}: " + ", ".join(
                f"{impl} {out[impl]['tok_s'][str(b)]:.1f} tok/s "
                f"({out[impl]['plain_step_s'][str(b)] * 1e3:.0f} ms/step)" for impl in impls),
                flush=True)
    finally:
        os.environ.pop(env_name, None)
        for srv in servers.values():
            srv.stop()
    base, cand = impls
    out[f"{cand}_over_{base}_tok_s"] = {b: out[cand]["tok_s"][b] / out[base]["tok_s"][b]
                                        for b in out[cand]["tok_s"]}
    return out
