"""The scheduler process's setup: its tqdm bars make no named semaphore, which its killing at
engine shutdown would leave to ``resource_tracker`` ("leaked semaphore objects")."""

from __future__ import annotations

import subprocess
import sys

_TQDM_SEMAPHORES = """
import multiprocessing as mp
from multiprocessing import resource_tracker

mp.set_start_method("spawn")  # as in sglang's processes: locks are named semaphores
made = []
resource_tracker.register = lambda name, rtype: made.append(rtype)
if {fixed}:
    from rhyme_sglang.sglang_ext.process import thread_lock_for_tqdm

    thread_lock_for_tqdm()
from tqdm import tqdm

for _ in tqdm(range(3)):
    pass
print(made.count("semaphore"))
"""


def _semaphores(fixed: bool) -> int:
    run = subprocess.run([sys.executable, "-c", _TQDM_SEMAPHORES.format(fixed=fixed)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split()[-1])


def test_scheduler_tqdm_bars_make_no_named_semaphore():
    assert _semaphores(fixed=False) == 1  # tqdm's default: a multiprocessing lock
    assert _semaphores(fixed=True) == 0
