"""Helpers shared by the CPU backend's test modules."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import torch

from rhyme_sglang import settings


@contextlib.contextmanager
def attention_impl(name):
    """RHYME_CPU_ATTENTION=name for the duration (not a fixture: hypothesis reruns the body)."""
    old = os.environ.get("RHYME_CPU_ATTENTION")
    os.environ["RHYME_CPU_ATTENTION"] = name
    settings.reload()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RHYME_CPU_ATTENTION")
        else:
            os.environ["RHYME_CPU_ATTENTION"] = old
        settings.reload()


def paged_cache(gen, seq_lens, kv_heads, head_dim, v_dim, dtype, spare_rows=2):
    """K/V buffers and a req_to_token table whose rows scatter each request over the pool.

    The batch's requests sit on shuffled rows among ``spare_rows`` unused ones; cells past a
    request's length hold an out-of-range location, so reading them would fail loudly.
    """
    bsz, width = len(seq_lens), max(seq_lens) + 3
    pool = sum(seq_lens) + 5
    k_buffer = torch.randn(pool, kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(pool, kv_heads, v_dim, generator=gen).to(dtype)
    req_to_token = torch.full((bsz + spare_rows, width), pool + 100, dtype=torch.int32)
    rows = torch.randperm(bsz + spare_rows, generator=gen)[:bsz]
    locs = torch.randperm(pool, generator=gen)
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = locs[used : used + n].int()
        used += n
    return k_buffer, v_buffer, req_to_token, rows


def random_tree(gen, n):
    """Ancestor-or-self mask [n, n] of a random tree whose node i has a parent < i."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


def run_python(code: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)
