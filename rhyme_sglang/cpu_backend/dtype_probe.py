"""The engine's dtype probe: one decoder layer's products at decode and verify row counts, per
dtype, with the kernels the engine runs in that dtype.

A decode step multiplies a few rows by every weight of the model, read from memory once: a
skinny, memory-bound product, where the kernel that streams the weight best wins, not the one
with the most arithmetic (a large GEMM, as the trainer runs, can favour bf16 2.5x on a CPU
whose bf16 decode products are slower than fp32's). So the probe times what a step does: a
layer's linears (SmolLM2-135M's shapes), each on enough copies of its weight to stream from
memory (:func:`.linear.streamed_copies`), on each of :data:`rhyme_sglang.dtypes.STEP_ROWS`
row counts, with every kernel :mod:`.linear` may choose for that dtype (``F.linear``, oneDNN,
the native few-row GEMM) and the fastest one kept per shape, as the engine's own measured
choice keeps it. :func:`rhyme_sglang.dtypes.decode_probe` caches the result and decides.
"""

from __future__ import annotations

import time

import torch

from rhyme_sglang.cpu_backend import linear, native_step

# (out, in) of one SmolLM2-135M decoder layer's fused linears: qkv, o, gate_up, down
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def revision() -> str:
    """What the probe's figures depend on besides the machine: the native kernels' revisions,
    ISA and page size (:func:`native_step.revisions`) and whether bf16 decodes natively (a
    kernel change measures again)."""
    kernels = native_step.revisions()
    if kernels == "none" or linear._native is None:
        return "native-none"
    return f"{kernels}-bf16{int(decodes_natively('bfloat16'))}"


def decodes_natively(dtype: str) -> bool:
    """Whether the engine's decode steps in ``dtype`` run the native kernels and step (fp32
    wherever the modules are built; bf16 only where the native GEMM runs bf16 weights, i.e.
    with avx512_bf16, and the decoder step takes bf16). Where not, the probe leaves the dtype
    out: its steps run sglang's per-op path, whose costs a product's time does not show."""
    if dtype == "float32":
        return True
    return linear.native_bf16() and native_step.takes_bf16()


def shape_seconds(out_features: int, in_features: int, dtype: torch.dtype, rows: tuple,
                  repeats: int, gen: torch.Generator) -> list[float]:
    """Per row count: seconds of one [rows, in] @ [in, out] product with its weight streamed
    from memory, on the fastest kernel for this dtype (best of ``repeats`` passes)."""
    weights = linear.streamed_copies(out_features, in_features, dtype, gen)
    kernels = linear.streamed_kernels(weights)
    seconds = []
    for r in rows:
        x = torch.randn(r, in_features, generator=gen).to(dtype)  # [rows, in]
        times = linear.best_times({name: (lambda f=f: f(x)) for name, f in kernels.items()},
                                  repeats, time.perf_counter() + 10.0, prune=1.5)
        seconds.append(min(times.values()) / len(weights))
    return seconds


def layer_seconds(dtype: str, rows: tuple, repeats: int = 3) -> tuple[float, ...]:
    """Per row count: seconds of one layer's linears in ``dtype`` on this thread setting."""
    gen = torch.Generator().manual_seed(0)
    total = [0.0] * len(rows)
    for out_features, in_features in LAYER_SHAPES:
        for i, s in enumerate(shape_seconds(out_features, in_features, getattr(torch, dtype),
                                            rows, repeats, gen)):
            total[i] += s
    return tuple(total)
