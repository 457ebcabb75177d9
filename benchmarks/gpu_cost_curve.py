"""Step-cost table of a dense decoder: forward seconds vs (batch, verify width, context).

One decode or verify step of ``batch`` requests, each feeding ``width + 1`` new tokens
(width 0 = plain decode) against a KV cache of ``context`` tokens per request, is timed with
plain PyTorch on random bf16 weights shaped by an HF config (Qwen2-like 1.5B/7B/14B or
Llama-like 8B presets, or any ``config.json`` via ``--hf-config``; nothing is downloaded).
The decoder is the usual stack (RMSNorm, QKV with GQA, rotary, SDPA over a preallocated
K/V cache, SwiGLU MLP, LM head over every new token) written out here, so it runs with any
transformers version (transformers only builds the config). On CUDA each point is captured
in a CUDA graph when possible (as serving engines run decode) and timed with CUDA events
after a warm-up; a point that does not fit in memory (KV cache ``batch x context``) is
recorded as skipped, an OOM skips the point, and a time budget stops early and writes what
it has. The JSON is the cost table read by :mod:`benchmarks.rollout_sim`.

    python -m benchmarks.gpu_cost_curve --model qwen2-7b --json benchmarks/data/cost_h200_qwen2-7b.json
    python -m benchmarks.gpu_cost_curve --device cpu --tiny --json /tmp/cost_tiny.json
    python -m benchmarks.gpu_cost_curve --roofline h200 --model qwen2-7b --json OUT

Needs torch (and transformers for the config, optional); imports nothing from rhyme_sglang.
``--roofline`` needs neither: it writes the same table from a bandwidth/compute model.

Table format (``FORMAT``)::

    {"format": "rhyme-step-cost/1", "kind": "measurement" | "model, not measurement",
     "device": str, "model": {"name", "params", "layers", "hidden", "heads", "kv_heads",
     "head_dim", "intermediate", "vocab"}, "dtype": "bfloat16", "assumptions": [str],
     "points": [{"context": int, "batch_size": int, "width": int, "tokens": int,
                 "seconds": float | null, "status": "ok" | "<why skipped>"}]}
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger("benchmarks.gpu_cost_curve")
FORMAT = "rhyme-step-cost/1"
# HF config fields of public model shapes (Qwen2/Qwen2.5 and Llama 3); weights are random.
PRESETS: Dict[str, dict] = {
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=152064, tie_word_embeddings=False),
    "qwen2-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824,
                      num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                      vocab_size=152064, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=256, tie_word_embeddings=True),
}
CONTEXTS = (1024, 4096, 16384)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WIDTHS = (0, 2, 4, 8, 16)
MAX_TOKENS = 4096
# Public datasheet figures (dense bf16 tensor-core peak, HBM bandwidth, memory).
GPUS = {
    "h100": {"name": "NVIDIA H100 SXM (datasheet)", "hbm_bytes_per_s": 3.35e12,
             "bf16_flops": 989e12, "memory_bytes": 80e9},
    "h200": {"name": "NVIDIA H200 SXM (datasheet)", "hbm_bytes_per_s": 4.8e12,
             "bf16_flops": 989e12, "memory_bytes": 141e9},
}
ROOFLINE_ASSUMPTIONS = {
    "bandwidth_efficiency": 0.8,  # share of the datasheet HBM bandwidth a decode step reaches
    "compute_efficiency": 0.6,  # share of the dense bf16 peak a verify GEMM reaches
    "step_overhead_s": 1.0e-3,  # scheduler, sampling and launches per step (CUDA graphs)
}


# ----------------------------------------------------------------------------- shapes
def model_shape(name: str, hf_config: Optional[str] = None) -> dict:
    """Dimensions of a preset or an HF ``config.json``, through ``transformers`` when present."""
    if hf_config:
        with open(hf_config) as fh:
            fields = json.load(fh)
        name = fields.get("_name_or_path") or hf_config
    elif name in PRESETS:
        fields = dict(PRESETS[name])
    else:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(PRESETS)} or --hf-config")
    try:
        from transformers import AutoConfig

        kind = fields.pop("model_type", "llama")
        cfg = AutoConfig.for_model(kind, **fields).to_dict()
    except ImportError:
        cfg = fields
    heads = cfg["num_attention_heads"]
    shape = {"name": name, "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
             "heads": heads, "kv_heads": cfg.get("num_key_value_heads") or heads,
             "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
             "intermediate": cfg["intermediate_size"], "vocab": cfg["vocab_size"],
             "qkv_bias": cfg.get("model_type", fields.get("model_type")) == "qwen2"
             or bool(cfg.get("attention_bias")),
             "tied": bool(cfg.get("tie_word_embeddings", False))}
    shape["params"] = param_count(shape)
    return shape


def _matmul_params(s: dict) -> int:
    """Weights multiplied by every token: attention + MLP of all layers, plus the LM head."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["intermediate"]
    return s["layers"] * per_layer + s["vocab"] * s["hidden"]


def param_count(s: dict) -> int:
    embed = 0 if s["tied"] else s["vocab"] * s["hidden"]
    return _matmul_params(s) + embed


def kv_bytes_per_token(s: dict, dtype_bytes: int = 2) -> int:
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * dtype_bytes


def grid(contexts: Sequence[int], batches: Sequence[int], widths: Sequence[int],
         max_tokens: int) -> List[dict]:
    """The (context, batch, width) points, tokens per forward = batch * (width + 1)."""
    return [{"context": c, "batch_size": b, "width": w, "tokens": b * (w + 1)}
            for c in contexts for b in batches for w in widths if b * (w + 1) <= max_tokens]


# ----------------------------------------------------------------------------- roofline
def roofline_seconds(s: dict, gpu: dict, batch: int, width: int, context: int,
                     assumptions: dict = ROOFLINE_ASSUMPTIONS) -> float:
    """max(bytes / bandwidth, FLOPs / peak) + overhead for one step.

    bytes = matmul weights (bf16, read once per step) + the batch's KV cache reads
    (context tokens per request); FLOPs = 2 * matmul params * tokens + attention
    (QK^T and PV: 4 * layers * heads * head_dim * context per new token)."""
    tokens = batch * (width + 1)
    weight_bytes = 2 * _matmul_params(s)
    kv_bytes = batch * context * kv_bytes_per_token(s)
    flops = 2 * _matmul_params(s) * tokens \
        + 4 * s["layers"] * s["heads"] * s["head_dim"] * (context + width + 1) * tokens
    memory_s = (weight_bytes + kv_bytes) / (gpu["hbm_bytes_per_s"] * assumptions["bandwidth_efficiency"])
    compute_s = flops / (gpu["bf16_flops"] * assumptions["compute_efficiency"])
    return max(memory_s, compute_s) + assumptions["step_overhead_s"]


def roofline_table(gpu_name: str, shape: dict, contexts=CONTEXTS, batches=BATCHES,
                   widths=WIDTHS, max_tokens: int = MAX_TOKENS) -> dict:
    if gpu_name not in GPUS:
        raise ValueError(f"unknown GPU {gpu_name!r}; choose from {sorted(GPUS)}")
    gpu = GPUS[gpu_name]
    a = ROOFLINE_ASSUMPTIONS
    points = [dict(p, seconds=roofline_seconds(shape, gpu, p["batch_size"], p["width"], p["context"]),
                   status="ok") for p in grid(contexts, batches, widths, max_tokens)]
    return {
        "format": FORMAT, "kind": "model, not measurement", "device": gpu["name"],
        "model": shape, "dtype": "bfloat16",
        "assumptions": [
            f"roofline model from datasheet figures: HBM {gpu['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"dense bf16 {gpu['bf16_flops'] / 1e12:.0f} TFLOP/s, memory {gpu['memory_bytes'] / 1e9:.0f} GB",
            f"step seconds = max((weight bytes + KV-cache bytes) / ({a['bandwidth_efficiency']} x HBM "
            f"bandwidth), FLOPs / ({a['compute_efficiency']} x bf16 peak)) + {a['step_overhead_s'] * 1e3:.1f} ms "
            "fixed per-step overhead",
            "weights read once per step (bf16, matmul weights incl. LM head); KV cache of `context` "
            "tokens per request read once per step; FLOPs = 2 x matmul params x tokens + attention",
            "no tensor parallelism; points whose KV cache exceeds the GPU memory are still listed",
            "draft lookup and tree-mask costs are not modelled",
        ],
        "points": points,
    }


# ----------------------------------------------------------------------------- measured
class Decoder:
    """Random-weight decoder of ``shape`` with a K/V cache for ``max_batch`` requests of
    ``context + max_new`` tokens; ``forward(ids)`` runs one step for ``ids: [B, S]`` whose
    cache holds ``context`` tokens each."""

    def __init__(self, shape: dict, device: str, dtype, max_batch: int, context: int,
                 max_new: int, seed: int = 0):
        import torch

        self.torch, self.s, self.context = torch, shape, context
        self.attention_form = "stacked"  # or "gqa": see forward
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, hd = shape["hidden"], shape["head_dim"]
        q, kv = shape["heads"] * hd, shape["kv_heads"] * hd

        def w(*size):
            return (torch.randn(*size, generator=g) * 0.02).to(device=device, dtype=dtype) \
                if math.prod(size) < 1 << 22 else \
                torch.empty(*size, device=device, dtype=dtype).normal_(0.0, 0.02)

        self.embed = w(shape["vocab"], h)
        self.lm_head = self.embed if shape["tied"] else w(shape["vocab"], h)
        self.layers = []
        for _ in range(shape["layers"]):
            self.layers.append({
                "ln1": torch.ones(h, device=device, dtype=dtype),
                "ln2": torch.ones(h, device=device, dtype=dtype),
                "qkv": w(q + 2 * kv, h),
                "qkv_b": w(q + 2 * kv) if shape["qkv_bias"] else None,
                "o": w(h, q), "gate_up": w(2 * shape["intermediate"], h),
                "down": w(h, shape["intermediate"]),
                # cache: [B, Hkv, context + max_new, D]; the first `context` slots are filled
                "k": w(max_batch, shape["kv_heads"], context + max_new, hd),
                "v": w(max_batch, shape["kv_heads"], context + max_new, hd),
            })
        self.norm = torch.ones(h, device=device, dtype=dtype)
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        pos = torch.arange(context + max_new, device=device, dtype=torch.float32)
        ang = torch.outer(pos, inv)  # [L, D/2]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def _rms(self, x, weight):
        x32 = x.float()
        return (x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def _rope(self, x, cos, sin):
        # x: [B, H, S, D]; rotate the two halves: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x.chunk(2, dim=-1)
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, ids):
        torch, s, ctx = self.torch, self.s, self.context
        F = torch.nn.functional
        B, S = ids.shape
        hd, H, Hkv = s["head_dim"], s["heads"], s["kv_heads"]
        G = H // Hkv
        cos, sin = self.cos[ctx:ctx + S], self.sin[ctx:ctx + S]  # [S, D/2]
        # query i (new token ctx + i) sees cache slots 0 .. ctx + i. "stacked": the G query heads
        # of one KV head are stacked along the sequence, q [B, Hkv, G*S, D] against k [B, Hkv, L, D],
        # with an explicit mask when S > 1 (no flash kernel takes it); "gqa": q [B, H, S, D] with
        # SDPA's own GQA and, when S > 1, a bottom-right causal bias, which flash kernels take
        # without a mask
        mask = None
        gqa = self.attention_form == "gqa"
        if gqa and S > 1:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(S, ctx + S)
        elif S > 1:
            keys = torch.arange(ctx + S, device=ids.device)
            mask = (keys[None, :] <= ctx + torch.arange(S, device=ids.device)[:, None]).repeat(G, 1)
        x = F.embedding(ids, self.embed)  # [B, S, h]
        for L in self.layers:
            a = F.linear(self._rms(x, L["ln1"]), L["qkv"], L["qkv_b"])
            q, k, v = a.split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
            q = self._rope(q.view(B, S, H, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(B, S, Hkv, hd).transpose(1, 2), cos, sin)
            L["k"][:B, :, ctx:ctx + S] = k
            L["v"][:B, :, ctx:ctx + S] = v.view(B, S, Hkv, hd).transpose(1, 2)
            keys, values = L["k"][:B, :, :ctx + S], L["v"][:B, :, :ctx + S]
            if gqa:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * S, hd), keys, values,
                                                   attn_mask=mask)
            o = o.reshape(B, H, S, hd).transpose(1, 2).reshape(B, S, H * hd)
            x = x + F.linear(o, L["o"])
            gate, up = F.linear(self._rms(x, L["ln2"]), L["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return F.linear(self._rms(x, self.norm), self.lm_head)  # logits [B, S, vocab]


def _time_point(dec: Decoder, batch: int, width: int, device: str, iters: int,
                use_graph: bool) -> tuple:
    """Median seconds of one step and whether a CUDA graph was used."""
    torch = dec.torch
    ids = torch.randint(0, dec.s["vocab"], (batch, width + 1), device=device)
    if device == "cpu":
        dec.forward(ids)  # warm-up
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dec.forward(ids)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), False
    run: Callable[[], object] = lambda: dec.forward(ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (also what graph capture needs)
            dec.forward(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec.forward(ids)
            run = graph.replay
        except Exception as exc:  # capture can fail for some kernels: time it eagerly
            logger.warning("CUDA graph capture failed at batch %d width %d (%s); eager", batch,
                           width, type(exc).__name__)
            graph = None
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    graphed = graph is not None
    del graph
    return statistics.median(times), graphed


def _time_forms(dec: Decoder, batch: int, width: int, device: str, iters: int,
                use_graph: bool) -> dict:
    """A point's record: the step is timed with both attention forms (see ``Decoder.forward``)
    and keeps the faster, as an engine picks its fastest kernel."""
    import torch

    timed = {}
    for form in ("stacked", "gqa"):
        dec.attention_form = form
        try:
            timed[form] = _time_point(dec, batch, width, device, iters, use_graph)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as exc:  # a torch without this SDPA form
            if form == "stacked":
                raise
            logger.warning("gqa attention failed at batch %d width %d (%s)", batch, width, exc)
    dec.attention_form = "stacked"
    best = min(timed, key=lambda form: timed[form][0])
    return {"seconds": timed[best][0], "status": "ok", "cuda_graph": timed[best][1],
            "attention": best, "seconds_by_attention": {f: t[0] for f, t in timed.items()}}


def measure(shape: dict, device: str, contexts=CONTEXTS, batches=BATCHES, widths=WIDTHS,
            max_tokens: int = MAX_TOKENS, budget_s: float = 420.0, iters: int = 5,
            cuda_graph: bool = True, memory_reserve: float = 0.12, seed: int = 0) -> dict:
    """Time every grid point that fits; returns the table (skipped points carry a status)."""
    import torch

    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    t_start = time.perf_counter()
    weights = 2 * param_count(shape)
    points = grid(contexts, batches, widths, max_tokens)
    max_new = max(widths) + 1
    if device != "cpu":
        total = torch.cuda.get_device_properties(0).total_memory
        free_for_kv = total * (1 - memory_reserve) - weights
        device_name = torch.cuda.get_device_name(0)
    else:
        free_for_kv, device_name = float("inf"), "cpu"
    out: List[dict] = []
    for ci, ctx in enumerate(contexts):
        todo = sorted((p for p in points if p["context"] == ctx), key=lambda p: p["tokens"])
        per_req = kv_bytes_per_token(shape, 2 if device != "cpu" else 4) * (ctx + max_new)
        fits = [b for b in batches if b * per_req <= free_for_kv]
        deadline = t_start + budget_s * (ci + 1) / len(contexts)
        dec = None
        try:
            if fits:
                dec = Decoder(shape, device, dtype, max(fits), ctx, max_new, seed)
        except torch.OutOfMemoryError:
            fits = []
        for p in todo:
            rec = dict(p, seconds=None)
            if p["batch_size"] not in fits:
                rec["status"] = (f"skipped: KV cache of {p['batch_size']} x {ctx} tokens "
                                 f"({p['batch_size'] * per_req / 1e9:.1f} GB) does not fit")
            elif time.perf_counter() > deadline:
                rec["status"] = "skipped: time budget"
            else:
                try:
                    rec.update(_time_forms(dec, p["batch_size"], p["width"], device, iters,
                                           cuda_graph))
                except torch.OutOfMemoryError:
                    rec["status"] = "skipped: out of memory"
                    torch.cuda.empty_cache()
            out.append(rec)
            logger.info("context %d batch %d width %d: %s", ctx, p["batch_size"], p["width"],
                        f"{rec['seconds'] * 1e3:.2f} ms" if rec["seconds"] else rec["status"])
        del dec
        if device != "cpu":
            torch.cuda.empty_cache()
    return {
        "format": FORMAT, "kind": "measurement", "device": device_name, "model": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "assumptions": [
            "random weights, plain PyTorch decoder (SDPA attention over a preallocated "
            "contiguous K/V cache; no paged attention, no fused kernels)",
            f"median of {iters} timed steps after warm-up, CUDA events"
            + (", each point captured in a CUDA graph where possible" if cuda_graph else ""),
            "every request of a step has the same context length; a verify step feeds "
            "width + 1 tokens per request (chain mask); LM head over every new token",
            "each step is timed with two SDPA forms (GQA heads stacked along the query axis, "
            "with an explicit mask in a verify; SDPA's enable_gqa, with a bottom-right causal "
            "bias in a verify) and keeps the faster",
            f"time budget {budget_s:.0f} s; skipped points are listed with the reason",
        ],
        "torch": torch.__version__, "wall_s": time.perf_counter() - t_start, "points": out,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2-7b", help=f"preset: {', '.join(sorted(PRESETS))}")
    ap.add_argument("--hf-config", default=None, help="an HF config.json instead of a preset")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model and grid (a seconds-long CPU test of the script)")
    ap.add_argument("--roofline", choices=sorted(GPUS), default=None,
                    help="write the roofline model table for this GPU instead of measuring")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop measuring after this")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--json", required=True, help="write the cost table here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.budget_s <= 0 or args.iters < 1:
        ap.error("--budget-s must be > 0 and --iters >= 1")
    shape = model_shape("tiny" if args.tiny else args.model, args.hf_config)
    kw = dict(contexts=(16, 64), batches=(1, 2, 4), widths=(0, 2), max_tokens=64) \
        if args.tiny else {}
    if args.roofline:
        table = roofline_table(args.roofline, shape, **kw)
    else:
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                ap.error("no CUDA device; use --device cpu or --roofline")
        table = measure(shape, args.device, budget_s=args.budget_s, iters=args.iters,
                        cuda_graph=not args.no_cuda_graph, **kw)
    with open(args.json, "w") as fh:
        json.dump(table, fh, indent=1)
    ok = [p for p in table["points"] if p["status"] == "ok"]
    by = {(p["context"], p["batch_size"], p["width"]): p["seconds"] for p in ok}
    c0 = min(p["context"] for p in table["points"])
    b = max((p["batch_size"] for p in ok if p["context"] == c0 and (c0, p["batch_size"], 0) in by
             and (c0, p["batch_size"], 2) in by), default=None)
    ratio = f"; verify width 2 / plain at context {c0} batch {b}: " \
        f"{by[c0, b, 2] / by[c0, b, 0]:.2f}x" if b else ""
    print(f"{table['kind']} on {table['device']} ({shape['name']}): {len(ok)}/{len(table['points'])} "
          f"points{ratio} -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
