"""Plain sampling on CPU side by side: the inverse-CDF draw against ``torch.multinomial``.

One run, same machine, one thread (as the engine's scheduler on 2 cores):

1. **ops**: one token per row of softmax probabilities over SmolLM2's 49152-token vocabulary
   at batch 1, 8, 32 and 64: ``torch.multinomial(probs, 1)`` (what sglang's torch sampler
   calls) against ``cpu_backend.sampling.sample_rows``; milliseconds, best of ``--repeats``;
2. **engine** (skip with ``--no-engine``): two vanilla SGLang servers of the model in the
   chosen dtype, one with ``RHYME_CPU_SAMPLING=torch`` and one with the default, up at once,
   sampling ``--max-new-tokens`` tokens at temperature 1.0 (``ignore_eos``) after
   ``--prompt-len``-token random prompts at batch 1, 8 and 32, their rounds alternating:
   median tok/s, seconds per plain decode step, and the ratio.

    python -m benchmarks.bench_sampling [--json out/sampling.json] [--quick]
"""

from __future__ import annotations

import time

from benchmarks.common import (op_and_engine_parser, servers_side_by_side,
                               write_json)
from rhyme_sglang import settings

OP_BATCHES = (1, 8, 32, 64)
ENGINE_BATCHES = (1, 8, 32)
VOCAB = 49152  # SmolLM2's


def ops_side_by_side(batches, vocab: int, repeats: int, seed: int) -> dict:
    import torch

    from rhyme_sglang.cpu_backend.sampling import sample_rows

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for batch in batches:
        probs = torch.softmax(3.0 * torch.randn(batch, vocab, generator=gen), dim=-1)
        row = {}
        for name, fn in (("multinomial", lambda: torch.multinomial(probs, 1)),
                         ("inverse_cdf", lambda: sample_rows(probs))):
            fn()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            row[f"{name}_ms"] = best * 1e3
        row["multinomial_over_inverse_cdf"] = row["multinomial_ms"] / row["inverse_cdf_ms"]
        out[str(batch)] = row
        print(f"  batch {batch}: multinomial {row['multinomial_ms']:.2f} ms, inverse CDF "
              f"{row['inverse_cdf_ms']:.2f} ms (x{row['multinomial_over_inverse_cdf']:.1f})",
              flush=True)
    return out


def main(argv=None) -> int:
    parser = op_and_engine_parser("python -m benchmarks.bench_sampling", prompt_len=128,
                                  repeats=10)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, tiny model engine")
    parser.add_argument("--json", default="out/sampling.json")
    args = parser.parse_args(argv)
    settings.prepare_cpu_env()

    import torch
    from transformers import AutoConfig

    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.machine import cpu_flags
    from rhyme_sglang.models import resolve_model_path

    torch.set_num_threads(1)
    if args.quick:
        args.model, args.prompt_len, args.max_new_tokens, args.repeats, args.rounds = "tiny", 16, 8, 2, 1
    print(f"bench_sampling, CPU flags {' '.join(cpu_flags()) or '-'}, 1 thread", flush=True)
    report = {"cpu_flags": cpu_flags(), "threads": 1, "vocab": VOCAB,
              "ops": ops_side_by_side(OP_BATCHES, VOCAB, args.repeats, args.seed)}
    if not args.no_engine:
        from benchmarks.bench_cpu_engine import _prompts

        dtype = resolve_dtype(args.dtype)
        model_path = resolve_model_path(args.model)
        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        prompts = _prompts(vocab, max(ENGINE_BATCHES), args.prompt_len, args.seed)
        report.update(dtype=dtype, model=args.model, prompt_len=args.prompt_len,
                      max_new_tokens=args.max_new_tokens, temperature=1.0)
        report["engine"] = servers_side_by_side(
            model_path, dtype, "RHYME_CPU_SAMPLING", ("torch", "inverse_cdf"), prompts,
            ENGINE_BATCHES, args.max_new_tokens, args.rounds, temperature=1.0,
            log_prefix="/tmp/bench_sampling")
        print("engine tok/s at temperature 1.0, inverse CDF / multinomial: " + ", ".join(
            f"batch {b}: x{r:.2f}"
            for b, r in report["engine"]["inverse_cdf_over_torch_tok_s"].items()))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
