"""An offline Engine's shutdown stops only the processes that Engine started.

SGLang's ``Engine.shutdown`` ends with ``kill_process_tree(os.getpid(), include_parent=False)``:
every child of the calling process dies, so an in-process Engine shut down beside a local Ray
instance (the demo's final side-by-side) or beside another Engine takes them down too.
:func:`children` lists this process's children (taken before and after an Engine starts);
:func:`sparing` swaps sglang's blanket kill for one that ends only the Engine's own children.
The reach into sglang is this one module-level name, ``engine.kill_process_tree``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Set

import psutil


def children() -> Set[int]:
    """PIDs of this process's direct children, less multiprocessing's helpers of the whole
    process: the resource tracker (the first spawned child starts it; killing it with one
    engine makes the next relaunch it and warn that resources may leak) and the fork server
    (it serves every engine of the process: :mod:`rhyme_sglang.sglang_ext.forkserver`)."""
    from multiprocessing import resource_tracker

    from rhyme_sglang.sglang_ext.forkserver import server_pid

    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    return {c.pid for c in psutil.Process().children(recursive=False)} - {tracker, server_pid()}


def kill_only(own: Set[int], kill_tree) -> None:
    """``kill_tree(pid)`` for each of ``own`` that is still alive (each one's tree)."""
    for pid in sorted(own):
        if psutil.pid_exists(pid):
            kill_tree(pid)


@contextmanager
def sparing(own: Set[int]) -> Iterator[None]:
    """While active, sglang's engine module kills only ``own`` when it kills this process's
    children; any other call passes through unchanged."""
    from sglang.srt.entrypoints import engine as sglang_engine

    original = sglang_engine.kill_process_tree

    def kill_process_tree(parent_pid=None, include_parent=True, *args, **kwargs):
        if (parent_pid is None or parent_pid == os.getpid()) and not include_parent:
            return kill_only(own, lambda pid: original(pid, *args, **kwargs))
        return original(parent_pid, include_parent, *args, **kwargs)

    sglang_engine.kill_process_tree = kill_process_tree
    try:
        yield
    finally:
        sglang_engine.kill_process_tree = original
