"""The number formats (``dtype: auto``), decided by measurement on this machine.

Two number-format decisions, each measured on the work it is about, each logged once with its
figures:

* the engines' (:func:`resolve_dtype`): a decode step multiplies a few rows by every weight,
  streamed from memory, so the **decode probe** times one decoder layer's products at the row
  counts of a plain step at batch 1 and 8 and a verify step (``STEP_ROWS``), per dtype, with the
  kernels the engine runs in that dtype (:mod:`rhyme_sglang.cpu_backend.dtype_probe`); bf16 when
  its steps take less time (geometric mean of the per-step ratios), else fp32. Cached in
  ``~/.cache/rhyme_sglang/decode_probe.json`` per machine, thread setting, probe version and
  native kernel revision (a kernel change measures again). ``RHYME_DECODE_PROBE="float32=3,
  bfloat16=4"`` (ms per probed step) injects a result.
* the trainer's autocast (:func:`resolve_train_dtype`): training is compute-bound, so the
  **GEMM probe** times one large single-thread product per dtype (``PROBE_SHAPE``, best of a
  few runs), cached in ``~/.cache/rhyme_sglang/gemm_probe.json`` per machine (CPU model, CPU
  flags, torch version); bf16 where it runs at least as fast as fp32.
  ``RHYME_GEMM_PROBE="float32=50,bfloat16=6"`` (GFLOP/s) injects a result.

With CUDA both are bf16. A dtype the user gives always wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

from rhyme_sglang import machine
from rhyme_sglang import settings as _settings
from rhyme_sglang.machine import cpu_flags, cpu_model, machine_key, usable_cores
from rhyme_sglang.settings import cache_root

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32", "half", "float")  # sglang's names
PROBE_SHAPE = (64, 576, 1536)  # rows x in x out: a SmolLM2 MLP projection at 64 tokens
PROBE_ENV = _settings.ENV_NAMES["gemm_probe"]
DECODE_PROBE_ENV = _settings.ENV_NAMES["decode_probe"]
# rows of the decode probe's steps: plain decode at batch 1 and 8, a verify of 8 draft tokens
STEP_ROWS = (1, 8, 9)
STEP_NAMES = ("plain b1", "plain b8", "verify 9 rows")
DECODE_PROBE_VERSION = 1  # in the cache key: a change of what the probe measures measures again


class GemmProbe(NamedTuple):
    """Single-thread rate of one large matrix product per dtype, in GFLOP/s."""

    float32: float
    bfloat16: float
    source: str  # measured | cached | injected

    def describe(self) -> str:
        return f"fp32 {self.float32:.1f} GFLOP/s, bf16 {self.bfloat16:.1f} GFLOP/s ({self.source})"


class DecodeProbe(NamedTuple):
    """Seconds of one decoder layer's products per dtype, one figure per ``STEP_ROWS`` step.
    ``bfloat16`` is empty where bf16 has no native decode step on this machine (no
    avx512_bf16): its steps would run sglang's per-op path, slower than any product shows."""

    float32: tuple
    bfloat16: tuple
    source: str  # measured | cached | injected

    def bf16_over_fp32(self) -> float:
        """Geometric mean over the steps of bf16's time over fp32's (< 1: bf16 is faster;
        infinite where bf16 has no native decode step)."""
        if not self.bfloat16:
            return math.inf
        logs = [math.log(b / f) for f, b in zip(self.float32, self.bfloat16)]
        return math.exp(sum(logs) / len(logs))

    def describe(self) -> str:
        if not self.bfloat16:
            steps = ", ".join(f"{n} {f * 1e3:.2f}" for n, f in zip(STEP_NAMES, self.float32))
            return f"layer products fp32 ms: {steps}; no native bf16 decode step ({self.source})"
        steps = ", ".join(f"{name} {f * 1e3:.2f} / {b * 1e3:.2f}" for name, f, b
                          in zip(STEP_NAMES, self.float32, self.bfloat16))
        return (f"layer products fp32 / bf16 ms: {steps}; bf16/fp32 x{self.bf16_over_fp32():.2f} "
                f"({self.source})")


def _explicit(requested: Optional[str]) -> Optional[str]:
    """A dtype the user gave (checked), None for ``auto``/None."""
    if requested in (None, "auto"):
        return None
    if requested not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {requested!r}")
    return requested


def choose_dtype(requested: Optional[str], probe: Optional[DecodeProbe], cuda: bool) -> str:
    """The engines' dtype: an explicit one wins; ``auto``/None is bf16 on CUDA, and on a CPU
    bf16 only when the decode probe's bf16 steps take less time than its fp32 ones."""
    explicit = _explicit(requested)
    if explicit or cuda:
        return explicit or "bfloat16"
    if probe is None:
        raise ValueError("dtype 'auto' on a CPU needs a decode probe result")
    return "bfloat16" if probe.bf16_over_fp32() < 1.0 else "float32"


def choose_train_dtype(requested: Optional[str], probe: Optional[GemmProbe], cuda: bool) -> str:
    """The trainer's autocast dtype: an explicit one wins; ``auto``/None is bf16 on CUDA, and
    on a CPU bf16 only when the GEMM probe says large bf16 products run at least as fast as fp32
    ones."""
    explicit = _explicit(requested)
    if explicit or cuda:
        return explicit or "bfloat16"
    if probe is None:
        raise ValueError("the trainer's dtype 'auto' on a CPU needs a GEMM probe result")
    return "bfloat16" if probe.bfloat16 >= probe.float32 else "float32"


def gemm_gflops(dtype: str, rows: int, k: int, n: int, repeats: int = 3,
                budget_s: float = 0.4) -> float:
    """Best-of-``repeats`` rate of ``[rows, k] @ [k, n]`` in this thread's torch settings."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, k, generator=gen).to(getattr(torch, dtype))
    b = torch.randn(k, n, generator=gen).to(getattr(torch, dtype))
    torch.mm(a, b)  # warm-up
    best, deadline = float("inf"), time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2.0 * rows * k * n / best / 1e9


def measure_probe() -> GemmProbe:
    """Run the GEMM probe on one thread (about 0.05 s with native bf16, up to ~0.5 s without)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {d: gemm_gflops(d, *PROBE_SHAPE) for d in ("float32", "bfloat16")}
    finally:
        torch.set_num_threads(threads)
    return GemmProbe(rates["float32"], rates["bfloat16"], "measured")


def measure_decode_probe() -> DecodeProbe:
    """Run the decode probe on the threads an engine computes with (about 1-3 s)."""
    from rhyme_sglang.cpu_backend import dtype_probe

    with machine.engine_threads_applied():
        times = {d: dtype_probe.layer_seconds(d, STEP_ROWS) if dtype_probe.decodes_natively(d)
                 else () for d in ("float32", "bfloat16")}
    return DecodeProbe(times["float32"], times["bfloat16"], "measured")


def parse_rates(text: str, name: str) -> dict:
    """``"float32=50,bfloat16=6"`` -> ``{"float32": 50.0, "bfloat16": 6.0}``; a ValueError
    naming the variable ``name`` and the text otherwise."""
    rates = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        try:
            rates[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or key.strip() not in ("float32", "bfloat16") or rates[key.strip()] <= 0:
            raise ValueError(f"{name} must look like 'float32=50,bfloat16=6', got {text!r}")
    if set(rates) != {"float32", "bfloat16"}:
        raise ValueError(f"{name} must give float32 and bfloat16, got {text!r}")
    return rates


def parse_probe(text: str) -> GemmProbe:
    """``RHYME_GEMM_PROBE``'s ``"float32=50,bfloat16=6"`` (GFLOP/s) -> ``GemmProbe``."""
    rates = parse_rates(text, PROBE_ENV)
    return GemmProbe(rates["float32"], rates["bfloat16"], "injected")


def parse_decode_probe(text: str) -> DecodeProbe:
    """``RHYME_DECODE_PROBE``'s ``"float32=3,bfloat16=4"`` (ms, every probed step) ->
    ``DecodeProbe``."""
    ms = parse_rates(text, DECODE_PROBE_ENV)
    steps = {d: (ms[d] / 1e3,) * len(STEP_ROWS) for d in ms}
    return DecodeProbe(steps["float32"], steps["bfloat16"], "injected")


def cache_path(name: str = "gemm_probe.json") -> Path:
    return cache_root() / name


def _read_table(cache: Path) -> dict:
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _cached(cache: Path, key: str, measure: Callable[[], NamedTuple],
            load: Callable[[dict], NamedTuple]) -> NamedTuple:
    """The probe cached under ``key`` in ``cache`` (``load`` reads its entry), else
    ``measure()``'s, then cached with the CPU it ran on."""
    try:
        return load(_read_table(cache)[key])
    except (KeyError, ValueError, TypeError):
        pass
    probe = measure()
    table = _read_table(cache)
    table[key] = {"float32": probe.float32, "bfloat16": probe.bfloat16, "cpu": cpu_model(),
                  "flags": cpu_flags()}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only home still runs, it just probes again next time
        logger.debug("could not cache a probe in %s: %s", cache, exc)
    return probe


def gemm_probe(cache: Optional[Path] = None, env: Optional[dict] = None) -> GemmProbe:
    """The injected GEMM probe (``RHYME_GEMM_PROBE``), else this machine's cached one, else a
    new measurement (then cached)."""
    injected = _settings.of(env).gemm_probe
    if injected:
        return parse_probe(injected)
    return _cached(cache or cache_path(), machine_key(), measure_probe,
                   lambda e: GemmProbe(float(e["float32"]), float(e["bfloat16"]), "cached"))


def decode_probe_key() -> str:
    """The decode probe's cache key: this machine, the engine's threads, the probe's version
    and the native kernels' revision."""
    from rhyme_sglang.cpu_backend import dtype_probe

    threads, kernels = machine.engine_threads()
    return "|".join([machine_key(), f"v{DECODE_PROBE_VERSION}", f"{threads}/{kernels}",
                     ",".join(map(str, STEP_ROWS)), dtype_probe.revision()])


def _load_decode(entry: dict) -> DecodeProbe:
    steps = {d: tuple(float(s) for s in entry[d]) for d in ("float32", "bfloat16")}
    if len(steps["float32"]) != len(STEP_ROWS) or len(steps["bfloat16"]) not in (0, len(STEP_ROWS)) \
            or min(steps["float32"] + steps["bfloat16"]) <= 0:
        raise ValueError("a decode probe entry of another shape")
    return DecodeProbe(steps["float32"], steps["bfloat16"], "cached")


def decode_probe(cache: Optional[Path] = None, env: Optional[dict] = None) -> DecodeProbe:
    """The injected decode probe (``RHYME_DECODE_PROBE``), else this machine's cached one, else
    a new measurement (then cached)."""
    injected = _settings.of(env).decode_probe
    if injected:
        return parse_decode_probe(injected)
    return _cached(cache or cache_path("decode_probe.json"), decode_probe_key(),
                   measure_decode_probe, _load_decode)


_logged: set = set()


def _log_once(what: str, dtype: str, why: str) -> None:
    if (what, dtype) not in _logged:
        _logged.add((what, dtype))
        logger.info("%s dtype auto -> %s (%s; CPU flags %s)", what, dtype, why,
                    " ".join(cpu_flags()) or "-")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve(what: str, requested: Optional[str], probe: Callable[[], NamedTuple],
             choose: Callable, label: str) -> str:
    """``choose(requested, probe(), cuda)`` on this machine (no probe with CUDA or an explicit
    dtype); the choice for ``auto`` is logged once per process with the probe's figures."""
    if _explicit(requested):
        return requested
    cuda = _cuda()
    result = None if cuda else probe()
    dtype = choose(requested, result, cuda)
    _log_once(what, dtype, "CUDA" if cuda else f"{label}: {result.describe()}")
    return dtype


def resolve_dtype(requested: Optional[str] = "auto") -> str:
    """The engines' dtype: :func:`choose_dtype` by the decode probe."""
    return _resolve("engine", requested, decode_probe, choose_dtype, "decode probe")


def resolve_train_dtype(requested: Optional[str] = "auto") -> str:
    """The trainer's autocast dtype: :func:`choose_train_dtype` by the GEMM probe."""
    return _resolve("trainer", requested, gemm_probe, choose_train_dtype, "GEMM probe")


# ---- threads ---------------------------------------------------------------------------------


def describe_machine() -> str:
    """One line for CLIs: what the dtype choices rest on (CUDA, or CPU flags + both probes)."""
    import torch

    if torch.cuda.is_available():
        return f"CUDA {torch.cuda.get_device_name(0)}"
    return (f"CPU flags {' '.join(cpu_flags()) or '-'}, {usable_cores()} cores, engine dtype "
            f"auto {resolve_dtype()} (decode probe {decode_probe().describe()}), trainer "
            f"{resolve_train_dtype()} (GEMM probe {gemm_probe().describe()})")
