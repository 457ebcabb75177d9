"""Snapshot paths of the HTTP server stay inside its snapshot directory (``--rhyme-snapshot-dir``).

``/rhyme/save``, ``/rhyme/load`` and ``--rhyme-snapshot-path`` take a path relative to the
directory (an absolute path is accepted only when it lies inside it). The path is resolved with
symlinks followed, so ``..``, a symlink that points out, or an absolute path elsewhere is refused
with a ``ValueError`` that names the path and never any file content. A file to load must start
with the snapshot header; the check reads only the header and its message echoes no bytes.
The in-process ``Engine`` API is not confined: a Python caller already holds the process's
file rights (``rhyme_sglang.Engine.rhyme_save`` writes where it is told).
"""

from __future__ import annotations

import os
from pathlib import Path

from rhyme_sglang.core.persist import MAGIC


def snapshot_dir(root: str) -> Path:
    """The resolved snapshot directory, created (mode 0700) when missing."""
    path = Path(root).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path.resolve()


def confine(path, root: str, *, must_exist: bool = False) -> str:
    """``path`` resolved inside ``root``; ValueError when it leaves it (or, with ``must_exist``,
    when it is not an existing snapshot file)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"snapshot path must be a non-empty string, got {path!r:.80}")
    base = snapshot_dir(root)
    resolved = (base / path).resolve()  # an absolute `path` replaces `base` here
    if resolved == base or base not in resolved.parents:
        raise ValueError(f"snapshot path {path!r} is outside the snapshot directory {str(base)!r} "
                         "(use a path relative to --rhyme-snapshot-dir)")
    if must_exist:
        if not resolved.is_file():
            raise ValueError(f"snapshot {path!r} does not exist in {str(base)!r}")
        with open(resolved, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{path!r} is not a draft-store snapshot")
    elif not resolved.parent.is_dir():
        raise ValueError(f"snapshot path {path!r}: its folder does not exist in {str(base)!r}")
    return os.fspath(resolved)
