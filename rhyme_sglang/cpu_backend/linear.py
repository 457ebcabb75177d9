"""CPU linear layers: oneDNN with pre-packed weights at the row counts where this machine
measures it faster than PyTorch's default GEMM.

PyTorch's fp32 CPU GEMM (MKL in the PyPI wheel) lays the weight out anew on every call. At the
few-row products of decode and verify that costs more than the product itself on some CPUs:
on an AMD EPYC with AVX2 only, one thread, ``[9, 576] @ [576, 3072]`` took 1706 us through
``F.linear`` and 580 us through oneDNN with the weight packed once; SmolLM2's whole set of
linears (30 layers + lm_head) at 2 / 9 / 18 rows took 69.5 / 154 / 195 ms against 35.4 / 64.4
/ 88.9 ms packed, and the same at 1 row (34 ms). Other CPUs differ, so nothing here is assumed:

* the choice is **measured per weight shape and row-count bucket** (``BUCKETS``), on the
  thread count the scheduler computes with, best of a few runs of each kernel, and cached per
  machine in ``~/.cache/rhyme_sglang/linear_kernels.json`` (the GEMM probe's key: CPU model,
  flags, torch version). A bucket is packed only where packing measured faster.
* a packed weight is a second copy (weights' memory doubles for the shapes that use it);
  ``RHYME_CPU_LINEAR=plain`` turns the whole thing off, ``packed`` forces it where oneDNN can
  pack (bf16 needs avx512bw/vl/dq or avx_ne_convert), ``auto`` (default) measures.
* packs follow the weights: every sglang weight update (disk, tensor, distributed, IPC) bumps
  ``generation()``, and a layer repacks on its next call (see :func:`weights_changed`).

Numerics: both kernels accumulate in fp32; results differ from each other by float rounding
(~1e-5 relative), as ``F.linear``'s own results already differ between row counts.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows; a call uses the first bucket >= its rows
MODE_ENV = "RHYME_CPU_LINEAR"
MODES = ("auto", "plain", "packed")
_PACKABLE = (torch.float32, torch.bfloat16)
_generation = 0


def generation() -> int:
    return _generation


def weights_changed() -> None:
    """Called after any in-place weight update: every pack is stale from now on."""
    global _generation
    _generation += 1


def mode(env: Optional[dict] = None) -> str:
    text = (os.environ if env is None else env).get(MODE_ENV, "auto").strip() or "auto"
    if text not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {MODES}, got {text!r}")
    return text


def bucket_index(rows: int) -> int:
    for i, size in enumerate(BUCKETS):
        if rows <= size:
            return i
    return len(BUCKETS) - 1


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's blocked copy of ``weight`` ([out, in]), or None where oneDNN cannot pack it."""
    if weight.dtype not in _PACKABLE or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (RuntimeError, AttributeError):  # e.g. bf16 on a CPU without avx512bw/avx_ne_convert
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _best_time(fn, repeats: int, deadline: float) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return best


def measure_choice(out_features: int, in_features: int, dtype: torch.dtype,
                   repeats: int = 3, budget_s: float = 1.5) -> tuple[bool, ...]:
    """Per bucket: True where the packed kernel ran faster than ``F.linear`` on this thread
    count (random data of the layer's shape; buckets past the time budget copy the last one
    measured)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    packed = pack(weight)
    if packed is None:
        return (False,) * len(BUCKETS)
    choice: list[bool] = []
    deadline = time.perf_counter() + budget_s
    for rows in BUCKETS:
        if choice and time.perf_counter() > deadline:
            choice.append(choice[-1])
            continue
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        plain = _best_time(lambda: F.linear(x, weight), repeats, deadline)
        fast = _best_time(lambda: packed_linear(x, packed, None), repeats, deadline)
        choice.append(fast < plain)
    return tuple(choice)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rhyme_sglang" / "linear_kernels.json"


_choices: dict = {}


def kernel_choice(out_features: int, in_features: int, dtype: torch.dtype,
                  cache: Optional[Path] = None) -> tuple[bool, ...]:
    """This machine's packed-or-not per bucket for one weight shape: in memory, else cached on
    disk, else measured (then cached). ``plain``/``packed`` modes skip the measurement."""
    current = mode()
    if current == "plain":
        return (False,) * len(BUCKETS)
    if current == "packed":
        return (True,) * len(BUCKETS)
    from rhyme_sglang.machine import machine_key

    key = "|".join([machine_key(), str(torch.get_num_threads()), str(dtype).removeprefix("torch."),
                    str(out_features), str(in_features), ",".join(map(str, BUCKETS))])
    if key in _choices:
        return _choices[key]
    cache = cache_path() if cache is None else cache
    try:
        table = json.loads(cache.read_text())
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    entry = table.get(key)
    if isinstance(entry, list) and len(entry) == len(BUCKETS):
        choice = tuple(bool(v) for v in entry)
    else:
        start = time.perf_counter()
        choice = measure_choice(out_features, in_features, dtype)
        logger.info("cpu linear [%d x %d] %s, %d threads: packed at rows %s (measured in %.2f s)",
                    out_features, in_features, dtype, torch.get_num_threads(),
                    [b for b, p in zip(BUCKETS, choice) if p] or "none",
                    time.perf_counter() - start)
        table[key] = list(choice)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, cache)
        except OSError as exc:  # a read-only home still runs; it measures again next time
            logger.debug("could not cache linear kernel choices in %s: %s", cache, exc)
    _choices[key] = choice
    return choice


class LinearState:
    """A layer's kernel choice and its packed weight (rebuilt when the weights change)."""

    __slots__ = ("choice", "packed", "generation", "weight_ptr")

    def __init__(self, choice: tuple[bool, ...]):
        self.choice = choice
        self.packed: Optional[torch.Tensor] = None
        self.generation = -1
        self.weight_ptr = 0

    def packed_for(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        ptr = weight.data_ptr()
        if self.generation != _generation or self.weight_ptr != ptr:
            self.packed = pack(weight)
            self.generation, self.weight_ptr = _generation, ptr
            if self.packed is None:
                self.choice = (False,) * len(BUCKETS)
        return self.packed


_STATE_ATTR = "_rhyme_cpu_linear"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` may run this product (CPU tensors of one packable dtype)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and x.dtype == weight.dtype and weight.dtype in _PACKABLE
            and not weight.requires_grad and x.shape[-1] == weight.shape[1])


def linear(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed kernel where this machine's choice for
    ``weight``'s shape and ``x``'s row count says so. State lives on ``module``."""
    state = getattr(module, _STATE_ATTR, None)
    if state is None:
        state = LinearState(kernel_choice(weight.shape[0], weight.shape[1], weight.dtype))
        setattr(module, _STATE_ATTR, state)
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 0 or not state.choice[bucket_index(rows)]:
        return F.linear(x, weight, bias)
    packed = state.packed_for(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if bias is not None and bias.dtype != x.dtype:
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, bias)
