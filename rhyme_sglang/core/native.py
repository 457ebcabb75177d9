"""Chooses the suffix-trie implementation: the native module when built, else the Python twin."""

from __future__ import annotations

import logging
from typing import Optional

from .pytree import PySuffixTrie

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "native", "python")
_native_module = None
_native_checked = False


def native_module():
    """The compiled `_rhyme_native` module, or None (logged once) when it is not built."""
    global _native_module, _native_checked
    if not _native_checked:
        _native_checked = True
        try:
            from . import _rhyme_native  # type: ignore[attr-defined]
            _native_module = _rhyme_native
        except ImportError as exc:
            logger.warning("rhyme native suffix trie not built (%s); using the pure-Python "
                           "implementation (slower). Build it with `pip install -e .`.", exc)
    return _native_module


def native_available() -> bool:
    return native_module() is not None


def make_trie(max_depth: int, backend: str = "auto"):
    """A suffix trie of `max_depth` from `backend` ('auto', 'native' or 'python')."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "python":
        mod: Optional[object] = native_module()
        if mod is not None:
            return mod.SuffixTrie(max_depth)
        if backend == "native":
            raise ValueError("backend='native' requested but the native module is not built")
    return PySuffixTrie(max_depth)


def resolve_backend(backend: str) -> str:
    """The backend `make_trie(backend)` would use, as 'native' or 'python'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "python":
        return "python"
    if native_available():
        return "native"
    if backend == "native":
        raise ValueError("backend='native' requested but the native module is not built")
    return "python"
