"""An Engine's shutdown kills only the processes that Engine started (SGLang's own shutdown
kills every child of the calling process: a local Ray instance beside it died in the demo)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_sglang_child_kill_spares_processes_the_engine_did_not_start():
    from rhyme_sglang.sglang_ext.engine import prepare_process

    prepare_process()  # the CPU environment before sglang
    from sglang.srt.entrypoints import engine as sglang_engine

    from rhyme_sglang.sglang_ext import own_children

    bystander, own = _sleeper(), _sleeper()
    try:
        assert {bystander.pid, own.pid} <= own_children.children()
        original = sglang_engine.kill_process_tree
        with own_children.sparing({own.pid}):
            sglang_engine.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=10)
        assert sglang_engine.kill_process_tree is original  # the seam is restored
        assert own.wait(timeout=10) is not None
        assert bystander.poll() is None  # still running
    finally:
        for p in (bystander, own):
            if p.poll() is None:
                p.kill()
                p.wait()
