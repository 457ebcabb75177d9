"""The native kernels' weight panels on transparent huge pages (2 MiB) where the kernel allows.

A CPU decode step streams every weight panel from memory once (SmolLM2-135M: 270 MB in bf16,
540 MB in fp32). On 4 KiB pages that is one TLB miss per 4 KiB, and in a virtual machine each
miss walks two page tables. Backed by 2 MiB pages, the same stream ran faster: measured on a
2-core AMD EPYC (`avx2 avx512_bf16 avx512*`, no AMX; SmolLM2's 30 layers and lm_head packed
bf16, 2 kernel threads, both page sizes in one process, alternated): 1-16 rows 7-15% faster,
fp32 1-9 rows 5-20%; a whole engine step gained less than that VM's noise (docs/cpu-backend.md
has the figures). The paged K/V cache gained nothing
from them (its rows are read a few at a time), so only panels use them.

Rules:

* :func:`empty` hands out tensors of at least :data:`MIN_BYTES` from chunks of anonymous
  memory mapped with ``madvise(MADV_HUGEPAGE)`` before the first touch (the kernel then backs
  each aligned 2 MiB of it with one huge page when it has one free; otherwise it falls back to
  small pages by itself). Smaller tensors, and every tensor where huge pages are off, come from
  ``torch.empty``.
* Tensors are carved from :data:`CHUNK_BYTES` chunks, 64-byte aligned; one larger than a chunk
  gets a mapping of its own. A chunk is unmapped when the last tensor carved from it is freed
  (each tensor is a view of its chunk), so repacking after a weight update frees the old
  chunks. At most one chunk is partly used at a time.
* On when ``RHYME_CPU_HUGEPAGES=on`` (the default), the platform is Linux and
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``. :func:`mode`
  names what is in use (``"thp"`` or ``"4k"``): measured kernel choices and step costs are
  keyed by it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from rhyme_sglang import settings as _settings

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20
MIN_BYTES = 256 << 10  # below this a tensor is too small to span a huge page usefully
ALIGN = 64
MADV_HUGEPAGE = 14
THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_lock = threading.Lock()
_chunk: Optional[torch.Tensor] = None  # uint8 view of the current chunk's aligned part
_used = 0
_state: dict = {}


@functools.lru_cache(maxsize=None)
def kernel_mode(path: Path = THP_SWITCH) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    ``"unknown"`` where the switch cannot be read (read once per path)."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def enabled(env: Optional[dict] = None) -> bool:
    """Whether panels go on huge pages in this process (see the module rules)."""
    return (_settings.of(env).cpu_hugepages == "on" and sys.platform.startswith("linux")
            and kernel_mode() in ("always", "madvise") and _madvise() is not None)


def mode() -> str:
    """``"thp"`` where panels go on huge pages, else ``"4k"``."""
    return "thp" if enabled() else "4k"


def _madvise():
    if "madvise" not in _state:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _state["madvise"] = fn
    return _state["madvise"]


def _mapping(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a fresh anonymous mapping of at least ``nbytes``, starting on a
    huge-page boundary and advised MADV_HUGEPAGE (the advice failing leaves small pages)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    aligned = whole[start:start + size]
    if _madvise()(aligned.data_ptr(), size, MADV_HUGEPAGE) != 0 and not _state.get("warned"):
        _state["warned"] = True
        logger.warning("madvise(MADV_HUGEPAGE) failed (errno %d): weight panels stay on 4 KiB pages",
                       ctypes.get_errno())
    return aligned


def empty(count: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``count`` elements: on huge pages where :func:`enabled`
    and it spans at least :data:`MIN_BYTES`, else from ``torch.empty``."""
    global _chunk, _used
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(count, dtype=dtype)
    need = -(-nbytes // ALIGN) * ALIGN
    with _lock:
        if need > CHUNK_BYTES:
            return _mapping(need)[:nbytes].view(dtype)
        if _chunk is None or _used + need > _chunk.numel():
            _chunk, _used = _mapping(CHUNK_BYTES), 0
        out = _chunk[_used:_used + nbytes].view(dtype)
        _used += need
    return out


def drop_chunk() -> None:
    """Forget the partly used chunk (tests; a process that packs no more)."""
    global _chunk, _used
    with _lock:
        _chunk, _used = None, 0
