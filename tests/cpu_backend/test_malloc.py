"""The scheduler's malloc settings: a step's large buffers are reused, not mapped again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rhyme_sglang.cpu_backend import malloc

# in a fresh interpreter: apply the settings, then fault-count ten 40 MB temporaries (larger
# than glibc's largest dynamic mmap threshold, so by default each one is a fresh mapping)
PROBE = """
import json, resource, sys
import torch
from rhyme_sglang.cpu_backend.malloc import keep_freed_memory
done = keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # the heap grows to hold them (those pages are mapped in any case)
    torch.empty(10 << 20).fill_(1.0)
before = faults()
for _ in range(10):
    torch.empty(10 << 20).fill_(1.0)
print(json.dumps({"done": done, "faults_per_buffer": (faults() - before) / 10}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE],
                         env={**os.environ, "RHYME_CPU_MALLOC": mode},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc._glibc() is None, reason="glibc's mallopt only")
def test_keep_reuses_large_buffers_where_glibc_maps_them_again():
    kept, default = _probe("keep"), _probe("glibc")
    assert kept["done"] == "keep" and default["done"] == "glibc"
    pages = (40 << 20) // 4096
    assert default["faults_per_buffer"] > pages / 2  # every buffer a fresh mapping
    assert kept["faults_per_buffer"] < pages / 100  # the heap's pages again


def test_a_bad_switch_names_the_variable():
    with pytest.raises(ValueError, match="RHYME_CPU_MALLOC"):
        malloc.keep_freed_memory({"RHYME_CPU_MALLOC": "jemalloc"})
    assert malloc.keep_freed_memory({"RHYME_CPU_MALLOC": "glibc"}) == "glibc"
