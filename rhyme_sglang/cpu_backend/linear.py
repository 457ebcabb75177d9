"""CPU linear layers: the fastest of three kernels this machine measures for each weight shape
and row count.

* ``plain``: ``F.linear`` (MKL in the PyPI wheel). It lays the weight out anew on every call;
  at the few-row products of decode and verify that costs more than the product on some CPUs.
* ``onednn``: oneDNN with the weight packed once (fp32 or bf16).
* ``native``: our kernel over a panel-packed weight (``_native/skinny_gemm.cpp``; fp32, and
  bf16 where the CPU has avx512_bf16, streaming half the bytes), built for few rows: each
  panel is streamed once for all rows, and every output element is one running sum over the
  inputs in order, so **a row's result does not depend on the other rows of the call**: a
  decode row and the same token inside a verify tree get the same bits.

Measured on an AMD EPYC with AVX2 only, one thread, SmolLM2-135M's linears (30 layers +
lm_head, weights streamed from memory as in a model step), ms: 1 row 41.6 (oneDNN) / 30.7
(native); 9 rows 73.2 / 51.4; 32 rows 153 / 119; ``F.linear`` is slower than both from 2 rows
up. On a 2-core EPYC with avx512_bf16 (issue 52; 2 kernel threads, streamed as above), the
native kernel at 1 / 8 / 16 rows: bf16 7.6 / 7.9 / 12.4 ms, fp32 14.8 / 14.2 / 23.6 ms.
Other CPUs differ, so nothing here is assumed:

* the choice is **measured per weight shape and row-count bucket** (``BUCKETS``), on the
  thread count the scheduler computes with, best of a few runs of each kernel, and cached per
  machine in ``~/.cache/rhyme_sglang/linear_kernels.json`` (the GEMM probe's key: CPU model,
  flags, torch version). Where the native kernel wins any bucket, every bucket uses it
  (:func:`row_independent`: lossless speculation needs a row's bits not to depend on the row
  count), so the measurement picks between the others only where native does not apply.
* a packed weight is a second copy (a third where some buckets pick oneDNN and others native).
  ``RHYME_CPU_LINEAR=plain`` turns the whole thing off, ``packed`` forces oneDNN where it can
  pack (bf16 needs avx512bw/vl/dq or avx_ne_convert), ``native`` forces ours where it applies
  (fp32, or bf16 with avx512_bf16; the module built), ``auto`` (default) measures.
* packs follow the weights: every sglang weight update (disk, tensor, distributed, IPC) bumps
  ``generation()``, and a layer repacks on its next call (see :func:`weights_changed`).

Numerics: every kernel accumulates in fp32 (bf16 products round the sum to bf16 once); results
differ between kernels by float rounding (~1e-5 relative before that last rounding), as
``F.linear``'s own results already differ between row counts.
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

from rhyme_sglang import settings as _settings
from rhyme_sglang.machine import kernel_threads

from . import hugepages

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows; a call uses the first bucket >= its rows
MODE_ENV = _settings.ENV_NAMES["cpu_linear"]
MODES = _settings.LINEAR_MODES
KERNELS = ("plain", "onednn", "native")
MEASURE_METHOD = "streamed-margin-all"  # in the cache key: choices measured another way are measured again
# Another kernel is chosen over the native one only when it is this much faster: where every
# linear of a layer is native for a row bucket, the whole decoder step runs as one native call
# (:mod:`.native_step`) instead of the Python layer loop, which costs about as much as the
# layer's linears at 8 rows (~0.5 ms a layer; issue 52: bf16 SmolLM2 at batch 8 lost
# its native step to a gate_up product 3% faster on oneDNN).
NATIVE_MARGIN = 1.25
_PACKABLE = (torch.float32, torch.bfloat16)
_generation = 0

try:
    from . import _rhyme_gemm as _native
except ImportError:  # not built: oneDNN and F.linear only
    _native = None


def native_bf16() -> bool:
    """Whether the native kernel runs bf16 weights on this CPU (it needs avx512_bf16)."""
    return _native is not None and hasattr(_native, "bf16") and _native.bf16()


def generation() -> int:
    return _generation


def weights_changed() -> None:
    """Called after any in-place weight update: every pack is stale from now on."""
    global _generation
    _generation += 1


def mode(env: Optional[dict] = None) -> str:
    return _settings.of(env).cpu_linear


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


def native_pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``weight`` ([out, in]) in the native kernel's panels, or None where it cannot run: fp32,
    or bf16 with an even ``in`` on a CPU with avx512_bf16 (:func:`native_bf16`)."""
    if (_native is None or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0):
        return None
    out_features, in_features = weight.shape
    width = _native.panel_width()
    src = weight.detach().contiguous()
    if weight.dtype == torch.float32:
        panels = hugepages.empty(-(-out_features // width) * width * in_features, torch.float32)
        _native.pack(src.data_ptr(), panels.data_ptr(), out_features, in_features)
        return panels
    if weight.dtype != torch.bfloat16 or not native_bf16() or in_features % 2:
        return None
    # [out_pad / width][in / 2][width] words, each two bf16 of neighbouring inputs
    panels = hugepages.empty(-(-out_features // width) * width * (in_features // 2), torch.int32)
    _native.pack_bf16(src.data_ptr(), panels.data_ptr(), out_features, in_features)
    return panels


def native_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the weight given by :func:`native_pack`, in ``x``'s dtype
    (fp32, or bf16 with fp32 sums rounded once: :func:`bf16_twin`)."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    gemm = _native.gemm_bf16 if x.dtype == torch.bfloat16 else _native.gemm
    gemm(rows.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
         y.data_ptr(), rows.shape[0], out_features, in_features, kernel_threads())
    return y.view(*x.shape[:-1], out_features)


def bf16_twin(x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the native bf16 product computes, in PyTorch: fp32 sums of the exact products of
    bf16 ``x`` [..., in] and ``weight`` [out, in] (+ ``bias``), rounded once to bf16. (The
    kernel adds in another order, so the two agree to fp32 rounding before the last one.)"""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def best_times(kernels: dict, repeats: int, deadline: float, prune: float = 0.0) -> dict:
    """Best time of each kernel over ``repeats`` rounds, the kernels taking turns within a
    round (so a drift of the machine's speed hits them alike). ``prune`` > 1: a kernel more
    than ``prune`` times slower than the best after a round runs no more rounds (only the
    fastest is wanted)."""
    for fn in kernels.values():
        fn()  # warm-up
    best = dict.fromkeys(kernels, float("inf"))
    running = dict(kernels)
    for _ in range(repeats):
        for name, fn in running.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
        if prune > 1.0:
            running = {n: f for n, f in running.items() if best[n] <= prune * min(best.values())}
        if time.perf_counter() > deadline:
            break
    return best


def _largest_cache_bytes() -> int:
    """The largest CPU cache the OS reports (32 MiB when it reports none)."""
    size = 32 << 20
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = max(size, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return size


def _copies(weight_bytes: int) -> int:
    """How many copies of a weight one timed pass runs through: together at least twice the
    largest cache (at most 64), so each call reads its weight from memory."""
    return max(1, min(64, -(-2 * _largest_cache_bytes() // max(1, weight_bytes))))


def streamed_kernels(weights: list[torch.Tensor]) -> dict:
    """Each kernel (``KERNELS``) that can run ``weights`` (copies of one [out, in] weight), as a
    function of x ([rows, in]) that runs it over every copy in turn: a pass that streams the
    weights from memory, as a model step does."""
    out_features = weights[0].shape[0]
    kernels = {"plain": lambda x: [F.linear(x, w) for w in weights]}
    onednn = [pack(w) for w in weights]
    if onednn[0] is not None:
        kernels["onednn"] = lambda x: [packed_linear(x, p, None) for p in onednn]
    panels = [native_pack(w) for w in weights]
    if panels[0] is not None:
        kernels["native"] = lambda x: [native_linear(x, p, out_features, None) for p in panels]
    return kernels


def streamed_copies(out_features: int, in_features: int, dtype: torch.dtype,
                    gen: torch.Generator) -> list[torch.Tensor]:
    """Random [out, in] weights, enough copies (:func:`_copies`) that a pass over them reads
    each from memory."""
    count = _copies(out_features * in_features * torch.finfo(dtype).bits // 8)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    return [weight] + [weight.clone() for _ in range(count - 1)]  # clones: a copy is faster than randn


def pick_kernel(times: dict) -> str:
    """The fastest kernel of ``times`` (seconds by name), the native one within NATIVE_MARGIN."""
    best = min(times, key=times.get)
    return "native" if times.get("native", float("inf")) <= NATIVE_MARGIN * times[best] else best


def measure_choice(out_features: int, in_features: int, dtype: torch.dtype,
                   repeats: int = 5, budget_s: float = 3.0) -> tuple[str, ...]:
    """Per bucket: the kernel (``KERNELS``) that ran fastest on this thread count (random
    data of the layer's shape). Buckets past the time budget are still measured, on one copy
    of the weight, warm-up and one pass: a bucket of many rows is bound by arithmetic, not by
    reading the weight, and a kernel's rank can change with the rows (a large weight on a CPU
    with a large cache, whose streamed copies use up the budget in the first buckets, had
    kept the one-row kernel at every bucket: bf16 lm_head at 72 rows took 44 ms native
    against 9 ms oneDNN on AMX).

    Measured as a model step runs its linears: back to back, each on a weight out of the
    caches. A pass calls the kernel on each of :func:`_copies` copies of the weight in turn;
    a kernel's time is its best pass over the number of copies. (Timing one call after
    flushing the caches also timed the wake-up of the kernel threads, which
    sleep during the flush but not between a step's calls, and so chose ``F.linear`` for
    one-row products that run 1.5-1.7x faster on the native kernel inside the model.)
    """
    gen = torch.Generator().manual_seed(0)
    weights = streamed_copies(out_features, in_features, dtype, gen)
    kernels = streamed_kernels(weights)
    if set(kernels) == {"plain"}:
        return ("plain",) * len(BUCKETS)
    choice: list[str] = []
    deadline = time.perf_counter() + budget_s
    for rows in BUCKETS:
        if choice and time.perf_counter() > deadline and len(weights) > 1:
            del weights[1:]  # past the budget: one copy
            kernels = streamed_kernels(weights)
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        times = best_times({name: (lambda f=f: f(x)) for name, f in kernels.items()}, repeats,
                           deadline)
        choice.append(pick_kernel(times))
    return tuple(choice)


def cache_path() -> Path:
    return _settings.cache_root() / "linear_kernels.json"


_choices: dict = {}


def kernel_choice(out_features: int, in_features: int, dtype: torch.dtype,
                  cache: Optional[Path] = None) -> tuple[str, ...]:
    """This machine's kernel per bucket for one weight shape: in memory, else cached on disk,
    else measured (then cached). The ``plain``/``packed``/``native`` modes skip measuring."""
    current = mode()
    if current in ("plain", "native"):
        return (current,) * len(BUCKETS)
    if current == "packed":
        return ("onednn",) * len(BUCKETS)
    from rhyme_sglang.machine import machine_key

    key = "|".join([machine_key(), MEASURE_METHOD, f"{torch.get_num_threads()}/{kernel_threads()}",
                    str(dtype).removeprefix("torch."),
                    str(out_features), str(in_features), ",".join(map(str, BUCKETS)),
                    ",".join(KERNELS), f"native-r{getattr(_native, 'revision', 0)}", hugepages.mode()])
    if key in _choices:
        return _choices[key]
    cache = cache_path() if cache is None else cache
    try:
        table = json.loads(cache.read_text())
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    entry = table.get(key)
    if isinstance(entry, list) and len(entry) == len(BUCKETS) and set(entry) <= set(KERNELS):
        choice = tuple(entry)
    else:
        start = time.perf_counter()
        choice = measure_choice(out_features, in_features, dtype)
        logger.info("cpu linear [%d x %d] %s, %d/%d threads (torch/kernel): kernels by rows %s "
                    "(measured in %.2f s)", out_features, in_features, dtype,
                    torch.get_num_threads(), kernel_threads(),
                    dict(zip(BUCKETS, choice)), time.perf_counter() - start)
        table[key] = list(choice)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, cache)
        except OSError as exc:  # a read-only home still runs; it measures again next time
            logger.debug("could not cache linear kernel choices in %s: %s", cache, exc)
    choice = row_independent(choice)
    _choices[key] = choice
    return choice


def row_independent(choice: tuple[str, ...]) -> tuple[str, ...]:
    """``choice`` with every bucket on the native kernel where any bucket measured it (it
    applies to the shape): a token's bits must not depend on the row count, or a verify (many
    rows) and the plain step it replaces (few) may round apart, and greedy tokens differ (an
    AMX Xeon measured oneDNN faster from 33 rows for the tiny model's bf16 shapes, and the
    lossless suite's bf16 greedy test failed). Elsewhere the measured kernels stand."""
    return ("native",) * len(choice) if "native" in choice else choice


class LinearState:
    """A layer's kernel choice and its packed weights (rebuilt when the weights change)."""

    __slots__ = ("choice", "packs", "generation", "weight_ptr")

    def __init__(self, choice: tuple[str, ...]):
        self.choice = choice
        self.packs: dict[str, Optional[torch.Tensor]] = {}
        self.generation = -1
        self.weight_ptr = 0

    def pack_for(self, kind: str, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """``weight`` packed for ``kind`` (``onednn`` or ``native``); None where it cannot be,
        and then no bucket asks for that kind again."""
        ptr = weight.data_ptr()
        if self.generation != _generation or self.weight_ptr != ptr:
            self.packs.clear()
            self.generation, self.weight_ptr = _generation, ptr
        if kind not in self.packs:
            self.packs[kind] = pack(weight) if kind == "onednn" else native_pack(weight)
            if self.packs[kind] is None:
                self.choice = tuple("plain" if c == kind else c for c in self.choice)
        return self.packs[kind]


_STATE_ATTR = "_rhyme_cpu_linear"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` may run this product (CPU tensors of one packable dtype)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and x.dtype == weight.dtype and weight.dtype in _PACKABLE
            and not weight.requires_grad and x.shape[-1] == weight.shape[1])


def linear(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel this machine's choice names for
    ``weight``'s shape and ``x``'s row count. State lives on ``module``."""
    state = getattr(module, _STATE_ATTR, None)
    if state is None:
        state = LinearState(kernel_choice(weight.shape[0], weight.shape[1], weight.dtype))
        setattr(module, _STATE_ATTR, state)
    rows = x.numel() // max(1, x.shape[-1])
    kind = state.choice[bucket_index(rows)] if rows else "plain"
    if kind == "plain" or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    packed = state.pack_for(kind, weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if kind == "native":
        return native_linear(x, packed, weight.shape[0], bias)
    return packed_linear(x, packed, bias)
