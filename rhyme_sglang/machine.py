"""Machine-dependent defaults, decided by measurement: the number format (``dtype: auto``).

``resolve_dtype("auto")`` is ``bfloat16`` only where this machine multiplies bf16 matrices at
least as fast as fp32 (a CPU with native bf16 units: AMX, avx512_bf16), else ``float32``; with
CUDA it is ``bfloat16``. The measurement is a sub-second single-thread GEMM probe
(``PROBE_SHAPE``, best of a few runs per dtype), cached in
``~/.cache/rhyme_sglang/gemm_probe.json`` per machine (CPU model, CPU flags, torch version).
``RHYME_GEMM_PROBE="float32=50,bfloat16=6"`` (GFLOP/s) injects a probe result instead
(tests; machines where the probe must not run). A dtype the user gives always wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import NamedTuple, Optional

logger = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32", "half", "float")  # sglang's names
PROBE_SHAPE = (64, 576, 1536)  # rows x in x out: a SmolLM2 MLP projection at 64 tokens
PROBE_ENV = "RHYME_GEMM_PROBE"
_FLAG_RE = re.compile(r"^(avx2|avx512\w*|amx\w*)$")


class GemmProbe(NamedTuple):
    """Single-thread matrix-product rate of each dtype, in GFLOP/s."""

    float32: float
    bfloat16: float
    source: str  # measured | cached | injected

    def describe(self) -> str:
        return f"fp32 {self.float32:.1f} GFLOP/s, bf16 {self.bfloat16:.1f} GFLOP/s ({self.source})"


def env_choice(name: str, choices: tuple, default: str, env: dict | None = None) -> str:
    """The value of the switch ``name`` in ``env`` (the process environment by default),
    ``default`` when unset or blank; a ValueError naming the variable when it is not one of
    ``choices``."""
    text = (os.environ if env is None else env).get(name, default).strip() or default
    if text not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {text!r}")
    return text


def choose_dtype(requested: Optional[str], probe: Optional[GemmProbe], cuda: bool) -> str:
    """The dtype to run: an explicit one wins; ``auto``/None is bf16 on CUDA, and on a CPU bf16
    only when the probe says bf16 GEMMs run at least as fast as fp32 ones."""
    if requested not in (None, "auto"):
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {requested!r}")
        return requested
    if cuda:
        return "bfloat16"
    if probe is None:
        raise ValueError("dtype 'auto' on a CPU needs a GEMM probe result")
    return "bfloat16" if probe.bfloat16 >= probe.float32 else "float32"


def cpu_flags() -> list[str]:
    """The vector/matrix ISA flags that decide GEMM speed (avx2, avx512*, amx*), sorted."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(f for f in line.split(":", 1)[1].split() if _FLAG_RE.match(f))
    return sorted(flags)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_key() -> str:
    import torch

    text = "|".join([cpu_model(), ",".join(cpu_flags()), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    """Run the probe on one thread (about 0.05 s with native bf16, up to ~0.5 s without)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {d: gemm_gflops(d, *PROBE_SHAPE) for d in ("float32", "bfloat16")}
    finally:
        torch.set_num_threads(threads)
    return GemmProbe(rates["float32"], rates["bfloat16"], "measured")


def parse_probe(text: str) -> GemmProbe:
    """``"float32=50,bfloat16=6"`` -> ``GemmProbe``; ValueError naming the text otherwise."""
    rates = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or name.strip() not in ("float32", "bfloat16") or rates[name.strip()] <= 0:
            raise ValueError(f"{PROBE_ENV} must look like 'float32=50,bfloat16=6', got {text!r}")
    if set(rates) != {"float32", "bfloat16"}:
        raise ValueError(f"{PROBE_ENV} must give float32 and bfloat16, got {text!r}")
    return GemmProbe(rates["float32"], rates["bfloat16"], "injected")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rhyme_sglang" / "gemm_probe.json"


def gemm_probe(cache: Optional[Path] = None, env: Optional[dict] = None) -> GemmProbe:
    """The injected probe (``RHYME_GEMM_PROBE``), else this machine's cached one, else a new
    measurement (then cached)."""
    env = os.environ if env is None else env
    if env.get(PROBE_ENV):
        return parse_probe(env[PROBE_ENV])
    cache = cache_path() if cache is None else cache
    key = machine_key()
    try:
        entry = json.loads(cache.read_text())[key]
        return GemmProbe(float(entry["float32"]), float(entry["bfloat16"]), "cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    probe = measure_probe()
    try:
        table = json.loads(cache.read_text()) if cache.exists() else {}
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"float32": probe.float32, "bfloat16": probe.bfloat16,
                  "cpu": cpu_model(), "flags": cpu_flags()}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only home still runs, it just probes again next time
        logger.debug("could not cache the GEMM probe in %s: %s", cache, exc)
    return probe


_logged: set = set()


def resolve_dtype(requested: Optional[str] = "auto") -> str:
    """``choose_dtype`` on this machine; the choice for ``auto`` is logged once per process."""
    if requested not in (None, "auto"):
        return choose_dtype(requested, None, False)
    import torch

    cuda = torch.cuda.is_available()
    probe = None if cuda else gemm_probe()
    dtype = choose_dtype(requested, probe, cuda)
    if dtype not in _logged:
        _logged.add(dtype)
        why = "CUDA" if cuda else probe.describe()
        logger.info("dtype auto -> %s (%s; CPU flags %s)", dtype, why, " ".join(cpu_flags()) or "-")
    return dtype


# ---- threads ---------------------------------------------------------------------------------
THREADS_ENV = "RHYME_CPU_THREADS"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _threads_env(env: Optional[dict], name: str) -> Optional[int]:
    """Environment variable ``name`` as a thread count >= 1, None when unset or ``auto``."""
    env = os.environ if env is None else env
    text = env.get(name, "").strip()
    if text in ("", "0", "auto"):
        return None
    if not text.isdigit():
        raise ValueError(f"{name} must be a positive int or 'auto', got {text!r}")
    return int(text)


def threads_from_env(env: Optional[dict] = None) -> Optional[int]:
    """``RHYME_CPU_THREADS`` as an int >= 1, None when unset or ``auto``."""
    return _threads_env(env, THREADS_ENV)


KERNEL_THREADS_ENV = "RHYME_KERNEL_THREADS"
_kernel_threads: Optional[int] = None  # this process's choice, once made


def kernel_threads_from_env(env: Optional[dict] = None) -> Optional[int]:
    """``RHYME_KERNEL_THREADS`` as an int >= 1, None when unset or ``auto``."""
    return _threads_env(env, KERNEL_THREADS_ENV)


def kernel_threads() -> int:
    """Threads of the native CPU kernels (the few-row GEMM, the paged attention), which run
    their parts on their own pool, apart from torch's intra-op threads: this process's choice
    (:func:`set_kernel_threads`; a scheduler makes it at start), else ``RHYME_KERNEL_THREADS``
    (read once), else torch's thread count."""
    global _kernel_threads
    if _kernel_threads is None:
        requested = kernel_threads_from_env()
        if requested is None:
            import torch

            return torch.get_num_threads()
        _kernel_threads = requested
    return _kernel_threads


def set_kernel_threads(threads: Optional[int]) -> None:
    """Fix this process's kernel threads (None: back to ``RHYME_KERNEL_THREADS`` / torch's)."""
    global _kernel_threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"kernel threads must be an int >= 1, got {threads!r}")
    _kernel_threads = threads


def _requested_or(requested: Optional[int], what: str, engines: int) -> Optional[int]:
    """A requested thread count, checked (None: not requested); checks ``engines`` too."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"{what} threads must be an int >= 1, got {requested!r}")
        return requested
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines!r}")
    return None


def choose_kernel_threads(requested: Optional[int], cores: int, engines: int = 1) -> int:
    """Native kernel threads of one engine's scheduler: a requested count wins; otherwise the
    usable cores shared by ``engines`` engines, at least 1. Unlike torch's OpenMP threads
    (:func:`choose_scheduler_threads`), the kernels' workers claim their parts one at a time
    (``_native/parts.h``): a worker whose core the tokenizer or detokenizer holds claims
    nothing and the others run its parts, so no core is held back for them (stop 35, 2-core
    AVX2 EPYC, SmolLM2 fp32: a plain step at batch 1 0.082 -> 0.070 s, a 9-token verify
    0.110 -> 0.070 s, with 1 -> 2 kernel threads)."""
    chosen = _requested_or(requested, "kernel", engines)
    return chosen if chosen is not None else max(1, cores // engines)


def set_scheduler_threads(env: Optional[dict] = None) -> int:
    """In the scheduler process: torch intra-op threads for the model's compute."""
    import torch

    threads = choose_scheduler_threads(threads_from_env(env), usable_cores())
    torch.set_num_threads(threads)
    kernels = choose_kernel_threads(kernel_threads_from_env(env), usable_cores())
    set_kernel_threads(kernels)
    logger.info("scheduler compute threads: %d torch, %d native kernel (%d usable cores)",
                threads, kernels, usable_cores())
    return threads


def choose_scheduler_threads(requested: Optional[int], cores: int, engines: int = 1) -> int:
    """Intra-op threads of one engine's scheduler: a requested count wins; otherwise the cores
    left after one each for the tokenizer and detokenizer processes, shared by ``engines``
    engines, at least 1. (Measured on 2 cores, SmolLM2 fp32, batch 1/8/32: 1 thread 14/58/131
    tok/s, 2 threads 7/8/44: an OpenMP thread that loses its core to the tokenizer or
    detokenizer stalls every GEMM at a barrier.)"""
    chosen = _requested_or(requested, "scheduler", engines)
    return chosen if chosen is not None else max(1, (cores - 2) // engines)


def choose_trainer_threads(requested: int, cores: int) -> int:
    """Trainer threads: a requested count (> 0) wins, else every core (the engines sleep while
    it trains; measured on 2 cores, SmolLM2 fp32 GRPO step: 2 threads 1.86x faster than 1)."""
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"trainer threads must be an int >= 0, got {requested!r}")
    return requested or cores


def export_scheduler_threads(threads: Optional[int], env: Optional[dict] = None,
                             kernels: Optional[int] = None) -> None:
    """Hand thread counts to the scheduler processes spawned after this call: torch's
    (``threads``) and the native kernels' (``kernels``); None leaves ``RHYME_CPU_THREADS`` /
    ``RHYME_KERNEL_THREADS`` as the user set them."""
    env = os.environ if env is None else env
    if threads is not None:
        env[THREADS_ENV] = str(choose_scheduler_threads(threads, 1))
    if kernels is not None:
        env[KERNEL_THREADS_ENV] = str(choose_kernel_threads(kernels, 1))


def describe_machine() -> str:
    """One line for CLIs: what the dtype choice rests on (CUDA, or CPU flags + GEMM probe)."""
    import torch

    if torch.cuda.is_available():
        return f"CUDA {torch.cuda.get_device_name(0)}"
    return f"CPU flags {' '.join(cpu_flags()) or '-'}, {usable_cores()} cores, GEMM probe {gemm_probe().describe()}"
