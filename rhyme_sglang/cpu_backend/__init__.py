"""rhyme-sglang's CPU backend for SGLang: a pure-PyTorch ``sgl_kernel`` stand-in + patches.

Usage: ``python -m rhyme_sglang.cpu_backend install`` writes a ``.pth`` file into the
active environment's site-packages so every Python process (sglang spawns its scheduler
and detokenizer) loads :mod:`.bootstrap`. ``status`` prints what is active.
On machines with the real CUDA ``sgl_kernel`` the stand-in is never used.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

PTH_NAME = "rhyme_sglang_cpu_backend.pth"
PTH_LINE = "import rhyme_sglang.cpu_backend.bootstrap\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_hook() -> Path:
    """Write the ``.pth`` hook (idempotent) and return its path."""
    path = pth_path()
    if not path.exists() or path.read_text() != PTH_LINE:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(PTH_LINE)
        os.replace(tmp, path)
    return path


def uninstall_hook() -> bool:
    path = pth_path()
    if path.exists():
        path.unlink()
        return True
    return False


def activate() -> None:
    """Install the finders in this process (what the ``.pth`` line does at start-up)."""
    from rhyme_sglang.cpu_backend import bootstrap

    bootstrap.install()
