"""The CPU attention side by side: the native paged kernel against the batched PyTorch ops.

One run, same machine, same threads (1, as the engine's scheduler on 2 cores):

1. **ops**: ``decode_attention_cpu`` and ``extend_attention_cpu`` (a verify tree of
   ``--verify-width`` + 1 tokens per request) on SmolLM2's attention shape (9 query heads,
   3 KV heads, head dim 64, 30 layers), each request's keys on scattered cache slots, at each
   batch x context, in fp32 and bf16: milliseconds per model step (30 layer calls), best of
   ``--repeats``, and the ratio torch / native;
2. **engine** (skip with ``--no-engine``): two vanilla SGLang servers of the model in the chosen
   dtype, one with ``RHYME_CPU_ATTENTION=torch`` and one with the native kernel, up at once,
   decoding greedily ``--max-new-tokens`` tokens after ``--prompt-len``-token random prompts
   (cached after a first round) at batch 1, 8, 32, their rounds alternating: median tok/s and
   seconds per plain decode step (a full round minus a one-token round), and the ratio.

    python -m benchmarks.bench_attention [--json out/attention.json] [--quick]
"""

from __future__ import annotations

import os

from benchmarks.common import (op_and_engine_parser, servers_side_by_side,
                               write_json)
from rhyme_sglang import settings

OP_CASES = [(1, 128), (1, 1024), (8, 512), (32, 128), (32, 512), (32, 1024)]  # (batch, context)
ENGINE_BATCHES = (1, 8, 32)
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def _op_case(batch: int, context: int, tree_n: int, dtype, seed: int):
    """A callable running one model step (LAYERS calls) of the op on a random paged cache."""
    import torch

    from rhyme_sglang.cpu_backend import attention

    gen = torch.Generator().manual_seed(seed)
    width = context + tree_n
    pool = batch * width + 16
    k_buf = torch.randn(pool, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_buf = torch.randn(pool, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[: batch * width].view(batch, width).int().contiguous()
    rows = torch.arange(batch)
    scale = HEAD_DIM ** -0.5
    if tree_n == 0:
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        o = torch.empty_like(q)
        seq = torch.full((batch,), context)

        def step():
            for _ in range(LAYERS):
                attention.decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, o, None, None, None,
                                               None, table, rows, seq, scale, 0.0, False, 0)
        return step
    tokens = batch * tree_n
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    o = torch.empty_like(q)
    tree = torch.eye(tree_n, dtype=torch.bool)
    for i in range(1, tree_n):  # a random tree: node i hangs below a node < i
        tree[i] |= tree[int(torch.randint(0, i, (1,), generator=gen))]
    trees = tree.repeat(batch, 1, 1).reshape(-1)
    ext = torch.full((batch,), tree_n, dtype=torch.int32)
    starts = torch.arange(batch) * tree_n
    seq = torch.full((batch,), context + tree_n)

    def step():
        for _ in range(LAYERS):
            attention.extend_attention_cpu(q, k, v, o, k_buf, v_buf, 1.0, 1.0, table, rows, seq,
                                           ext, starts, tree_n, scale, 0.0, False, 0, None, None,
                                           trees, True)
    return step


def _best_ms(fn, repeats: int) -> float:
    from benchmarks.bench_cpu_engine import _timed

    fn()  # warm-up
    return min(_timed(fn) for _ in range(repeats)) * 1e3


def ops_side_by_side(cases, tree_n: int, repeats: int) -> dict:
    import torch

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind, n in (("decode", 0), (f"verify{tree_n}", tree_n)):
            for batch, context in cases:
                row = {}
                for impl in ("torch", "native"):
                    os.environ["RHYME_CPU_ATTENTION"] = impl
                    settings.reload()
                    row[f"{impl}_ms"] = _best_ms(_op_case(batch, context, n, dtype, seed=batch + context), repeats)
                row["torch_over_native"] = row["torch_ms"] / row["native_ms"]
                key = f"{str(dtype).removeprefix('torch.')} {kind} batch {batch} context {context}"
                results[key] = row
                print(f"  {key}: torch {row['torch_ms']:.1f} ms, native {row['native_ms']:.1f} ms "
                      f"per step (x{row['torch_over_native']:.2f})", flush=True)
    os.environ.pop("RHYME_CPU_ATTENTION", None)
    settings.reload()
    return results


def main(argv=None) -> int:
    parser = op_and_engine_parser("python -m benchmarks.bench_attention", prompt_len=512,
                                  repeats=5)
    parser.add_argument("--verify-width", type=int, default=8)
    parser.add_argument("--no-ops", action="store_true", help="the engine only")
    parser.add_argument("--quick", action="store_true", help="small op cases, tiny model engine")
    parser.add_argument("--json", default="out/attention.json")
    args = parser.parse_args(argv)
    settings.prepare_cpu_env()

    import torch
    from transformers import AutoConfig

    from rhyme_sglang.cpu_backend import attention
    from rhyme_sglang.dtypes import resolve_dtype
    from rhyme_sglang.machine import cpu_flags
    from rhyme_sglang.models import resolve_model_path

    if attention._native is None:
        raise SystemExit("the native attention module is not built: run `make setup` "
                         "(or `pip install -e .`) first")
    torch.set_num_threads(1)
    cases = [(1, 32), (4, 64)] if args.quick else OP_CASES
    if args.quick:
        args.model, args.prompt_len, args.max_new_tokens, args.repeats, args.rounds = "tiny", 32, 8, 2, 1
    print(f"bench_attention, CPU flags {' '.join(cpu_flags()) or '-'}, 1 thread", flush=True)
    report = {"cpu_flags": cpu_flags(), "threads": 1, "layers": LAYERS,
              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
              "verify_width": args.verify_width,
              "ops": {} if args.no_ops else ops_side_by_side(cases, args.verify_width + 1, args.repeats)}
    if not args.no_engine:
        dtype = resolve_dtype(args.dtype)
        model_path = resolve_model_path(args.model)
        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        report.update(dtype=dtype, model=args.model, prompt_len=args.prompt_len,
                      max_new_tokens=args.max_new_tokens)
        from benchmarks.bench_cpu_engine import _prompts

        prompts = _prompts(vocab, max(ENGINE_BATCHES), args.prompt_len, args.seed)
        report["engine"] = servers_side_by_side(
            model_path, dtype, "RHYME_CPU_ATTENTION", ("torch", "native"), prompts,
            ENGINE_BATCHES, args.max_new_tokens, args.rounds, log_prefix="/tmp/bench_attention")
        print("engine tok/s, native / torch attention: " + ", ".join(
            f"batch {b}: x{r:.2f}" for b, r in report["engine"]["native_over_torch_tok_s"].items()))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
