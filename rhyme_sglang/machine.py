"""Facts about this machine, and the thread counts decided from them.

* CPU facts: the ISA flags that decide kernel speed (:func:`cpu_flags`), the CPU model, and a
  key of both plus the torch version under which measurements are cached (:func:`machine_key`).
* Threads: an engine scheduler's torch threads (the cores left after the tokenizer and
  detokenizer processes), its native kernels' threads (every usable core: their workers claim
  parts one at a time, so a busy core slows nothing), the trainer's (every core). A count the
  user gives (``RHYME_CPU_THREADS``, ``RHYME_KERNEL_THREADS``, a config) always wins.

The number formats are decided by measurement in :mod:`rhyme_sglang.dtypes`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Optional

from rhyme_sglang import settings as _settings

logger = logging.getLogger(__name__)

_FLAG_RE = re.compile(r"^(avx2|avx512\w*|amx\w*)$")


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


def engine_threads() -> tuple[int, int]:
    """(torch, native kernel) threads of one engine's scheduler on this machine: the rules of
    :func:`set_scheduler_threads`."""
    cores = usable_cores()
    return (choose_scheduler_threads(threads_from_env(), cores),
            choose_kernel_threads(kernel_threads_from_env(), cores))


@contextlib.contextmanager
def engine_threads_applied():
    """This process's torch and native-kernel threads set to one engine's for the duration
    (what a probe of the engine's work runs on), restored after."""
    global _kernel_threads
    import torch

    saved = torch.get_num_threads(), _kernel_threads
    threads, kernels = engine_threads()
    torch.set_num_threads(threads)
    set_kernel_threads(kernels)
    try:
        yield threads, kernels
    finally:
        torch.set_num_threads(saved[0])
        _kernel_threads = saved[1]


THREADS_ENV = _settings.ENV_NAMES["cpu_threads"]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_from_env(env: Optional[dict] = None) -> Optional[int]:
    """``RHYME_CPU_THREADS`` as an int >= 1, None when unset or ``auto``."""
    return _settings.of(env).cpu_threads


KERNEL_THREADS_ENV = _settings.ENV_NAMES["kernel_threads"]
_kernel_threads: Optional[int] = None  # this process's choice, once made


def kernel_threads_from_env(env: Optional[dict] = None) -> Optional[int]:
    """``RHYME_KERNEL_THREADS`` as an int >= 1, None when unset or ``auto``."""
    return _settings.of(env).kernel_threads


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
    nothing and the others run its parts, so no core is held back for them (2-core
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
    if env is os.environ:
        _settings.reload()
