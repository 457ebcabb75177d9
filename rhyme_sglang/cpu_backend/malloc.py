"""glibc malloc settings of a CPU scheduler process: freed step buffers stay mapped.

A decode step on CPU allocates the same large temporaries every time (SmolLM2 at batch 32:
the ``[32, 49152]`` fp32 probabilities, their fp64 cumulative sums for the draw, the logits;
a verify's logits are ``bs * nodes`` rows). glibc's default policy decides by the sizes it
has seen whether such a block comes from the heap or from its own ``mmap``, and gives freed
memory at the heap's top back to the kernel once it exceeds twice that threshold. Depending
on where a step's buffers land, the next step then maps them again, and every page of a fresh
mapping costs a page fault and a zeroing. Measured (2-core AVX2 EPYC, fp32, batch 32
x 64 tokens, plain steps only): the RHYME scheduler took ~5000 minor faults a step (20 MB)
where vanilla's took ~700, and its plain steps ran 17-24% slower than vanilla's with the same
forward; with the settings below both take none and the gap is gone.

:func:`keep_freed_memory` sets, through ``mallopt``: no trimming of the heap's top
(``M_TRIM_THRESHOLD``), the largest fixed mmap threshold (``M_MMAP_THRESHOLD``, which also
stops glibc's adjustment) and no mmap for allocations (``M_MMAP_MAX`` = 0), so every block
comes from the heap and is reused. The process's resident size stays at its peak (what the
largest step needed; the model and KV pool are resident anyway). ``RHYME_CPU_MALLOC=glibc``
leaves glibc's defaults. Other C libraries (musl) and allocators preloaded with
``LD_PRELOAD`` (tcmalloc, jemalloc: the ``mallopt`` symbol then is not glibc's or is a no-op)
are left alone: the function reports what it did.
"""

from __future__ import annotations

import ctypes
import logging

from rhyme_sglang import settings as _settings

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h) and the values set
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
SETTINGS = ((M_TRIM_THRESHOLD, 2**31 - 1), (M_MMAP_THRESHOLD, 32 << 20), (M_MMAP_MAX, 0))


def _glibc():
    """This process's glibc (None under another C library): the symbols already loaded, so
    no library search runs at scheduler start."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(env: dict | None = None) -> str:
    """Apply the module's malloc settings in this process (``RHYME_CPU_MALLOC``: ``keep``, the
    default, or ``glibc``). Returns what was done: ``"keep"``, ``"glibc"`` (asked to leave
    the defaults) or ``"unsupported"`` (no glibc, or a ``mallopt`` call refused)."""
    if _settings.of(env).cpu_malloc == "glibc":
        return "glibc"
    libc = _glibc()
    if libc is None:
        return "unsupported"
    for param, value in SETTINGS:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            logger.warning("mallopt(%d, %d) refused: glibc's malloc defaults stay", param, value)
            return "unsupported"
    return "keep"
