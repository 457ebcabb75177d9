"""Entry point of sglang's scheduler process (spawned), with rhyme-sglang's setup first."""

from __future__ import annotations


def run_scheduler_process(*args, **kwargs):
    """Activate the CPU backend in this fresh process, then run sglang's scheduler."""
    from rhyme_sglang.sglang_ext.cpu_defaults import apply_cpu_defaults

    apply_cpu_defaults({})
    from sglang.srt.managers.scheduler import run_scheduler_process as _run

    return _run(*args, **kwargs)
